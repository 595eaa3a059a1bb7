"""Sliding-window decoders (Mistral v0.1 style, Qwen2 ``use_sliding_window``) against
transformers: logits of paged prefill chunks and decodes past the window, greedy generation
through ``LLM``, and the KV blocks behind the window freed (and found again by prefix caching).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from factories.decoders import GENERATION_DECODER, save_generation_decoder
from factories.generation import hf_greedy, make_llm, random_prompts, record_steps, token_prompts
from factories.seeded import hf_config, random_model

from cenote import SamplingParams
from cenote.forward_context import AttentionMetadata, forward_context
from cenote.kv_cache.manager import KVCacheManager
from cenote.models.config_reader import read_model_config
from cenote.models.layers.attention import kv_cache_shape
from cenote.models.loader import load_model
from cenote.request import Request

ATOL = 1e-4  # DESIGN.md §3: logits vs transformers, fp32
WINDOW = 5
BLOCK_SIZE = 4
_SMALL = dict(GENERATION_DECODER, tie_word_embeddings=False)
# name -> (config class, causal-LM class, overrides); qwen2_mixed slides layer 1 only
VARIANTS: dict[str, tuple[str, str, dict]] = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=WINDOW)),
    "qwen2_mixed": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
    ),
}


def make_sliding_decoder(folder: Path, variant: str, seed: int = 0, **extra) -> torch.nn.Module:
    """Save a seeded random fp32 sliding-window decoder + word tokenizer; returns it."""
    config_class, model_class, overrides = VARIANTS[variant]
    config = hf_config(config_class, _SMALL, overrides, extra)
    return save_generation_decoder(folder, random_model(model_class, config, seed))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    theirs = make_sliding_decoder(folder, request.param)
    ours = load_model(read_model_config(folder, dtype="float32"))
    return request.param, ours, theirs


# ---- logits of paged chunks and decodes ------------------------------------------------------

# (request, first token, end token) scheduled per step: prefills longer than the window, a chunk
# after cached context, lone and batched decodes, all past the window
STEPS: list[list[tuple[int, int, int]]] = [
    [(0, 0, 9), (1, 0, 3)],
    [(0, 9, 12), (1, 3, 4)],
    [(0, 12, 13), (1, 4, 5)],
    [(0, 13, 14), (1, 5, 11)],
    [(1, 11, 12)],
]
BLOCK_TABLES = [[0, 5, 2, 7], [3, 1, 6]]


def _step_metadata(
    step: list[tuple[int, int, int]], kv_caches: list[torch.Tensor], free_behind: bool
) -> AttentionMetadata:
    """With ``free_behind``, blocks that end before the window of the step's first query are
    -1 in the table, as the KV manager leaves them: attention must never read them."""
    loc, slots, tables = [0], [], []
    for request, start, end in step:
        loc.append(loc[-1] + end - start)
        table = list(BLOCK_TABLES[request])
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        if free_behind:
            first_visible = max(0, start - WINDOW + 1) // BLOCK_SIZE
            table[:first_visible] = [-1] * first_visible
        tables.append(table)
    return AttentionMetadata(
        query_start_loc=loc,
        seq_lens=[end for _, _, end in step],
        causal=True,
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        block_tables=tables,
        block_size=BLOCK_SIZE,
        kv_caches=kv_caches,
    )


def test_paged_chunks_and_decodes_past_the_window_match_transformers(pair) -> None:
    variant, ours, theirs = pair
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator) for n in (14, 12)]
    with torch.no_grad():
        expected = [theirs(p.unsqueeze(0)).logits[0].float() for p in prompts]
    kv_caches = [
        torch.zeros(kv_cache_shape(8, BLOCK_SIZE, ours.num_kv_heads, ours.head_dim))
        for _ in range(ours.num_layers)
    ]
    # only a model whose every layer slides may lose the blocks behind the window
    free_behind = ours.kv_sliding_window is not None
    assert free_behind == (variant == "mistral")
    for step in STEPS:
        input_ids = torch.cat([prompts[r][s:e] for r, s, e in step])
        positions = torch.cat([torch.arange(s, e) for _, s, e in step])
        with torch.no_grad(), forward_context(_step_metadata(step, kv_caches, free_behind)):
            logits = ours.compute_logits(ours(input_ids, positions))
        offset = 0
        for request, start, end in step:
            got = logits[offset : offset + end - start]
            torch.testing.assert_close(got, expected[request][start:end], atol=ATOL, rtol=0)
            offset += end - start


def test_flat_batch_without_cache_matches_transformers(pair) -> None:
    _, ours, theirs = pair
    prompts = random_prompts([13, 4, 9], seed=3)
    loc = [0]
    for prompt in prompts:
        loc.append(loc[-1] + len(prompt))
    metadata = AttentionMetadata(loc, [len(p) for p in prompts], causal=True)
    input_ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    with torch.no_grad(), forward_context(metadata):
        logits = ours.compute_logits(ours(input_ids, positions))
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = theirs(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(logits[loc[i] : loc[i + 1]], expected, atol=ATOL, rtol=0)


# ---- greedy generation through LLM -----------------------------------------------------------

MAX_NEW = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory):
    """Mistral with window 8: prompts of 3 to 21 tokens and 24 new tokens run well past it."""
    folder = tmp_path_factory.mktemp("mistral_llm")
    theirs = make_sliding_decoder(folder, "mistral", seed=2, sliding_window=8)
    prompts = random_prompts([3, 9, 21, 6], seed=4)
    return folder, prompts, hf_greedy(theirs, prompts, MAX_NEW)


def test_greedy_past_the_window_matches_transformers(mistral) -> None:
    folder, prompts, expected = mistral
    llm = make_llm(folder, block_size=BLOCK_SIZE)
    # the window no longer caps the context: max_model_len is the model's own
    assert llm.config.model.max_model_len == _SMALL["max_position_embeddings"]
    assert llm.engine.kv_cache_manager.sliding_window == 8
    for prompt, tokens in zip(prompts, expected, strict=True):
        (out,) = llm.generate(token_prompts([prompt]), GREEDY, use_tqdm=False)
        assert out.outputs[0].token_ids == tokens
    outs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_chunked_prefill_past_the_window_matches_transformers(mistral) -> None:
    folder, prompts, expected = mistral
    llm = make_llm(folder, block_size=BLOCK_SIZE, max_num_batched_tokens=5)
    outs = llm.generate(token_prompts(prompts), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_blocks_behind_the_window_are_freed_and_reused(mistral) -> None:
    """Two requests of 33 and 30 tokens need 9 + 8 blocks with full attention; with window 8
    each holds at most 3 blocks at a time, so 10 blocks serve both without preemption."""
    folder, prompts, expected = mistral
    llm = make_llm(folder, block_size=BLOCK_SIZE, num_gpu_blocks_override=10, max_model_len=40)
    steps = record_steps(llm)
    outs = llm.generate(token_prompts([prompts[1], prompts[3]]), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [expected[1], expected[3]]
    assert not any(step.preempted_request_ids for step in steps)
    freed = [s.block_ids for step in steps for s in step.scheduled if -1 in s.block_ids]
    assert freed, "no block was ever freed behind the window"
    for step in steps:
        held = [b for s in step.scheduled for b in s.block_ids if b != -1]
        assert len(held) == len(set(held)), "a block is held twice"
        for s in step.scheduled:
            assert len([b for b in s.block_ids if b != -1]) <= 3
    manager = llm.engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks


def test_prefix_cache_hits_with_a_sliding_window(mistral) -> None:
    folder, prompts, expected = mistral
    llm = make_llm(folder, block_size=BLOCK_SIZE)
    (first,) = llm.generate(token_prompts([prompts[2]]), GREEDY, use_tqdm=False)
    (again,) = llm.generate(token_prompts([prompts[2]]), GREEDY, use_tqdm=False)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == expected[2]
    assert again.num_cached_tokens == 20  # five full blocks of the 21-token prompt


def test_mixed_layers_keep_every_block(tmp_path: Path) -> None:
    theirs = make_sliding_decoder(tmp_path, "qwen2_mixed", seed=3)
    prompts = random_prompts([4, 11], seed=6)
    expected = hf_greedy(theirs, prompts, 16)
    llm = make_llm(tmp_path, block_size=BLOCK_SIZE)
    assert llm.engine.kv_cache_manager.sliding_window is None  # the full layer reads them all
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


# ---- configs ---------------------------------------------------------------------------------


def _layer_windows(config: dict) -> list[int | None]:
    from cenote.models.sliding_window import layer_windows

    return layer_windows(config, 4)


def test_which_layers_slide() -> None:
    assert _layer_windows({"model_type": "mistral", "sliding_window": 16}) == [16] * 4
    assert _layer_windows({"model_type": "mistral", "sliding_window": None}) == [None] * 4
    # Qwen2 hub configs carry a window they do not use
    qwen = {"model_type": "qwen2", "sliding_window": 32, "max_window_layers": 2}
    assert _layer_windows({**qwen, "use_sliding_window": False}) == [None] * 4
    assert _layer_windows({**qwen, "use_sliding_window": True}) == [None, None, 32, 32]
    # Llama ignores the key, as transformers does
    assert _layer_windows({"model_type": "llama", "sliding_window": 8}) == [None] * 4


def test_unknown_rope_scaling_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    make_sliding_decoder(tmp_path, "mistral")
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'yarn' is not supported; supported: default, linear"):
        load_model(read_model_config(tmp_path, dtype="float32"))


# ---- the KV manager alone --------------------------------------------------------------------


def test_manager_frees_blocks_behind_the_window() -> None:
    manager = KVCacheManager(8, block_size=BLOCK_SIZE, sliding_window=WINDOW)
    request = Request("a", list(range(100, 106)), sampling_params=None, pooling_params=None)
    assert manager.allocate_slots(request, 6) is not None  # prompt: blocks 0, 1
    request.num_computed_tokens = 6
    held = []
    for token in range(20):  # decode one token at a time up to position 25
        request.append_output_token_ids([token])
        assert manager.allocate_slots(request, 1) is not None
        request.num_computed_tokens += 1
        ids = manager.get_block_ids("a")
        first_visible = max(0, request.num_computed_tokens - 1 - WINDOW + 1) // BLOCK_SIZE
        assert all(b == -1 for b in ids[:first_visible]), ids
        assert all(b != -1 for b in ids[first_visible:]), ids
        held.append(sum(b != -1 for b in ids))
        assert manager.num_free_blocks == 8 - held[-1]
    assert max(held) == 2  # the query and the 4 keys before it span two blocks (of 7)
    # the freed blocks keep their content: the same prompt hits the prefix cache
    twin = Request("b", list(range(100, 106)), sampling_params=None, pooling_params=None)
    blocks, num_cached = manager.get_computed_blocks(twin)
    assert num_cached == 4 and blocks[0].block_hash is not None
    manager.free(request)
    assert manager.num_free_blocks == 8
