"""LoRA adapters per request, against adapters written by ``peft`` itself (issue 31).

A tiny random Llama and BERT base, random adapters (``init_lora_weights=False``: B is not zero)
saved by ``peft``; the reference is peft's merged model (the adapter folded into the weights)
run by transformers, and sentence-transformers with the adapter loaded for embeddings.
Adapters with their own classification head (``modules_to_save``) and ``--max-cpu-loras``:
tests/engine/test_lora_heads.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from factories.decoders import make_decoder
from factories.encoders import make_encoder
from factories.generation import (
    hf_greedy,
    hf_log_softmax,
    make_llm,
    random_prompts,
    record_steps,
    token_prompts,
)
from factories.lora import write_adapter
from factories.st_folders import with_st_pooling
from factories.texts import random_prompts as random_encoder_prompts

from cenote import LoRARequest, PoolingParams, SamplingParams
from cenote.lora.manager import LoRAManager
from cenote.models.layers import lora
from cenote.models.layers.lora import (
    SMALL_RUN_ROWS,
    LoRABatch,
    LoRABlock,
    LoRAGroup,
    LoRAHost,
    lora_context,
)
from cenote.runner.decode_stack import DecodeStackStep

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MAX_NEW = 8
LOGPROB_ATOL = 1e-4  # DESIGN.md §3: logits 1e-4 in fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance in fp32


class Decoder:
    """A Llama base and three adapters: every projection (r=4), q/v only with rsLoRA (r=8),
    the MLP only (r=2, alpha 16)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.base_path = root / "base"
        self.base = make_decoder(self.base_path, "llama")
        specs = {
            "all": dict(targets=ALL_PROJECTIONS, r=4, lora_alpha=8),
            "qv": dict(targets=["q_proj", "v_proj"], r=8, lora_alpha=4, use_rslora=True),
            "mlp": dict(targets=["gate_proj", "up_proj", "down_proj"], r=2, lora_alpha=16),
        }
        self.merged: dict[str | None, torch.nn.Module] = {None: self.base}
        self.adapters: dict[str, LoRARequest] = {}
        for i, (name, spec) in enumerate(specs.items()):
            spec = dict(spec)
            targets = spec.pop("targets")
            self.merged[name] = write_adapter(self.base, root / name, 10 + i, targets, **spec)
            self.adapters[name] = LoRARequest(name, i + 1, str(root / name))
        self.llm = make_llm(self.base_path, max_lora_rank=8, num_gpu_blocks_override=256)
        self.prompts = random_prompts([5, 11, 17, 23], seed=3)


@pytest.fixture(scope="module")
def decoder(tmp_path_factory) -> Decoder:
    return Decoder(tmp_path_factory.mktemp("lora_decoder"))


def _generate(decoder: Decoder, prompts, adapters, **options):
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, **options)
    return decoder.llm.generate(token_prompts(prompts), params, lora_request=adapters)


@pytest.mark.parametrize("name", [None, "all", "qv", "mlp"])
def test_greedy_tokens_equal_peft_merged_model(decoder: Decoder, name) -> None:
    adapter = None if name is None else decoder.adapters[name]
    outputs = _generate(decoder, decoder.prompts, adapter)
    expected = hf_greedy(decoder.merged[name], decoder.prompts, MAX_NEW)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    if name is not None:  # the adapter changes the answer: the test can tell
        assert expected != hf_greedy(decoder.base, decoder.prompts, MAX_NEW)


@pytest.mark.parametrize("name", ["all", "qv", "mlp"])
def test_logprobs_equal_peft_merged_model(decoder: Decoder, name) -> None:
    prompt = decoder.prompts[2]
    (out,) = _generate(decoder, [prompt], decoder.adapters[name], prompt_logprobs=3, logprobs=3)
    tokens = out.outputs[0].token_ids
    reference = hf_log_softmax(decoder.merged[name], prompt + tokens)  # row i predicts i + 1
    for i in range(1, len(prompt)):
        for token_id, entry in out.prompt_logprobs[i].items():
            assert entry.logprob == pytest.approx(
                reference[i - 1, token_id].item(), abs=LOGPROB_ATOL
            )
    for step, entry in enumerate(out.outputs[0].logprobs):
        for token_id, logprob in entry.items():
            expected = reference[len(prompt) - 1 + step, token_id].item()
            assert logprob.logprob == pytest.approx(expected, abs=LOGPROB_ATOL)


def test_mixed_batch_equals_each_request_alone(decoder: Decoder) -> None:
    """Three adapters and the base in one step: the base matmul once, each adapter's update on
    its own rows; every request's tokens and logprobs are what it gets alone."""
    names = [None, "all", "qv", "mlp", "all", None, "mlp", "qv"]
    prompts = random_prompts([6, 9, 13, 4, 15, 8, 11, 7], seed=5)
    adapters = [None if n is None else decoder.adapters[n] for n in names]
    steps = record_steps(decoder.llm)
    mixed = _generate(decoder, prompts, adapters, logprobs=2)
    assert any(len({s.lora_int_id for s in step.scheduled}) == 4 for step in steps)
    for out, prompt, adapter in zip(mixed, prompts, adapters, strict=True):
        (alone,) = _generate(decoder, [prompt], adapter, logprobs=2)
        assert out.outputs[0].token_ids == alone.outputs[0].token_ids
        for entry, single in zip(out.outputs[0].logprobs, alone.outputs[0].logprobs, strict=True):
            for token_id, logprob in entry.items():
                assert abs(logprob.logprob - single[token_id].logprob) <= BATCH_ATOL


def test_decode_stack_runs_adapter_steps(decoder: Decoder, monkeypatch) -> None:
    """The C++ decode stack adds the adapters' updates itself: decode steps with an adapter
    run on it, and their tokens are peft's merged model's (tests/kernels/test_decode_stack.py: the
    stack is bit-identical to the layer-by-layer path)."""
    ran: list[bool] = []  # per fused-decode call: whether the stack ran the step
    original = DecodeStackStep.__call__

    def spy(self, *args):
        result = original(self, *args)
        ran.append(result is not None)
        return result

    monkeypatch.setattr(DecodeStackStep, "__call__", spy)
    prompts = decoder.prompts[:2]
    outputs = _generate(decoder, prompts, decoder.adapters["all"])
    assert any(ran)
    expected = hf_greedy(decoder.merged["all"], prompts, MAX_NEW)
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_prefix_cache_keeps_adapters_apart(decoder: Decoder) -> None:
    """The same prompt under two adapters and the base: no KV block is shared, each gets its
    own answer; the same adapter again hits its own blocks."""
    prompt = random_prompts([40], seed=9)[0]  # two full blocks of 16 and more
    order = ["all", "qv", None, "all"]
    results = []
    for name in order:
        adapter = None if name is None else decoder.adapters[name]
        (out,) = _generate(decoder, [prompt], adapter)
        results.append(out)
        assert out.outputs[0].token_ids == hf_greedy(decoder.merged[name], [prompt], MAX_NEW)[0]
    assert [r.num_cached_tokens for r in results[:3]] == [0, 0, 0]
    assert results[3].num_cached_tokens == 32


# ---- bad input ------------------------------------------------------------------------------


def _refused(decoder: Decoder, adapter: LoRARequest, *fragments: str) -> None:
    with pytest.raises(ValueError) as info:
        _generate(decoder, decoder.prompts[:1], adapter)
    for fragment in fragments:
        assert fragment in str(info.value)
    # the engine is alive and the base answers as before
    (out,) = _generate(decoder, decoder.prompts[:1], None)
    assert out.outputs[0].token_ids == hf_greedy(decoder.base, decoder.prompts[:1], MAX_NEW)[0]


def test_rank_above_max_lora_rank_is_refused(decoder: Decoder, tmp_path) -> None:
    write_adapter(decoder.base, tmp_path / "big", 3, ["q_proj"], r=16, lora_alpha=16)
    adapter = LoRARequest("big", 40, str(tmp_path / "big"))
    _refused(decoder, adapter, "rank 16", "max_lora_rank=8")


def test_adapter_for_another_base_is_refused_naming_shapes(decoder: Decoder, tmp_path) -> None:
    other = make_decoder(tmp_path / "other", "llama", hidden_size=32, head_dim=8)
    write_adapter(other, tmp_path / "other_adapter", 3, ["q_proj"], r=4, lora_alpha=8)
    adapter = LoRARequest("other", 41, str(tmp_path / "other_adapter"))
    _refused(decoder, adapter, "does not fit this base model", "(4, 32)", "(64, 64)")


def test_dora_is_refused(decoder: Decoder, tmp_path) -> None:
    write_adapter(decoder.base, tmp_path / "dora", 3, ["q_proj"], r=4, lora_alpha=8, use_dora=True)
    _refused(decoder, LoRARequest("dora", 42, str(tmp_path / "dora")), "DoRA")


def test_embedding_and_tied_head_adapters_are_refused(decoder: Decoder, tmp_path) -> None:
    write_adapter(decoder.base, tmp_path / "embed", 3, ["embed_tokens"], r=4, lora_alpha=8)
    _refused(decoder, LoRARequest("embed", 43, str(tmp_path / "embed")), "embedding-layer LoRA")
    write_adapter(decoder.base, tmp_path / "head", 3, ["lm_head", "q_proj"], r=4, lora_alpha=8)
    _refused(decoder, LoRARequest("head", 46, str(tmp_path / "head")), "lm_head", "not supported")


def test_missing_folder_and_reused_id_are_refused(decoder: Decoder, tmp_path) -> None:
    _refused(decoder, LoRARequest("none", 45, str(tmp_path / "absent")), "adapter_config.json")
    taken = decoder.adapters["all"]
    _generate(decoder, decoder.prompts[:1], taken)  # resident under its id
    clash = LoRARequest("clash", taken.lora_int_id, str(decoder.root / "qv"))
    _refused(decoder, clash, "needs an id of its own")
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("zero", 0, str(decoder.root / "qv"))


# ---- pooling: a BERT embedding base -----------------------------------------------------------


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_encoder")
    base = make_encoder(root / "raw", "bert", seed=4)
    folder = with_st_pooling(root / "raw", root / "st", "mean", normalize=True)
    targets = ["query", "value", "attention.output.dense", "intermediate.dense"]
    merged = write_adapter(base, root / "adapter", 7, targets, r=4, lora_alpha=8)
    llm = make_llm(folder)
    return base, merged, root, llm


def _mean_pooled(model: torch.nn.Module, prompts: list[list[int]]) -> torch.Tensor:
    with torch.no_grad():
        rows = [model(input_ids=torch.tensor([p])).last_hidden_state[0].mean(0) for p in prompts]
    return F.normalize(torch.stack(rows), dim=-1)


def test_embeddings_equal_sentence_transformers_with_the_adapter(encoder) -> None:
    from sentence_transformers import SentenceTransformer

    base, merged, root, llm = encoder
    prompts = random_encoder_prompts([5, 17, 40], seed=2)
    adapter = LoRARequest("domain", 1, str(root / "adapter"))
    ours = torch.stack(
        [
            torch.tensor(o.outputs.embedding)
            for o in llm.embed(token_prompts(prompts), lora_request=adapter)
        ]
    )
    st = SentenceTransformer(str(root / "st"), device="cpu")
    st.load_adapter(str(root / "adapter"))
    features = [
        {"input_ids": torch.tensor([p]), "attention_mask": torch.ones(1, len(p))} for p in prompts
    ]
    with torch.no_grad():
        theirs = torch.cat([st(f)["sentence_embedding"] for f in features])
    assert F.cosine_similarity(ours, theirs).min() >= 0.9999
    assert F.cosine_similarity(ours, _mean_pooled(merged, prompts)).min() >= 0.9999
    base_rows = torch.stack(
        [torch.tensor(o.outputs.embedding) for o in llm.embed(token_prompts(prompts))]
    )  # the base, with the adapter resident: untouched
    assert F.cosine_similarity(base_rows, _mean_pooled(base, prompts)).min() >= 0.9999
    assert F.cosine_similarity(base_rows, ours).min() < 0.999  # the adapter moved them


def test_target_outside_the_trunk_linears_is_refused(encoder) -> None:
    base, _, root, llm = encoder
    write_adapter(base, root / "pooler", 3, ["pooler.dense", "query"], r=4, lora_alpha=8)
    with pytest.raises(ValueError, match="targets 'pooler.dense', which is not a linear layer"):
        llm.embed(["a b"], lora_request=LoRARequest("pooler", 9, str(root / "pooler")))
    assert llm.embed(["a b"])[0].outputs.embedding  # the engine is alive


def test_embedding_batch_mixing_adapter_and_base_equals_alone(encoder) -> None:
    _, _, root, llm = encoder
    prompts = random_encoder_prompts([5, 17, 40, 9], seed=6)
    adapter = LoRARequest("domain", 1, str(root / "adapter"))
    adapters = [adapter, None, adapter, None]
    mixed = llm.encode(token_prompts(prompts), PoolingParams(), lora_request=adapters)
    for out, prompt, choice in zip(mixed, prompts, adapters, strict=True):
        (alone,) = llm.encode(token_prompts([prompt]), PoolingParams(), lora_request=choice)
        torch.testing.assert_close(out.outputs.data, alone.outputs.data, atol=BATCH_ATOL, rtol=0)


def test_step_batch_makes_one_run_per_adjacent_adapter_requests() -> None:
    """Requests of one adapter side by side (the runner orders a step by adapter) are one run
    of rows; the update then reads and writes slices."""
    manager = LoRAManager(object(), 4, 8, torch.float32, torch.device("cpu"))
    ids, ends, counts = [None, 1, 1, 2, None, 1], [3, 5, 9, 10, 12, 13], [3, 2, 4, 1, 2, 1]
    batch = manager.step_batch(ids, ends, counts)
    assert batch is not None
    assert batch.groups == (LoRAGroup(1, 3, 9), LoRAGroup(2, 9, 10), LoRAGroup(1, 12, 13))
    assert manager.step_batch([2, 2], [4, 6], [4, 2]) == LoRABatch((LoRAGroup(2, 0, None),))
    assert manager.step_batch([None, None], [4, 6], [4, 2]) is None


def test_small_runs_of_a_bf16_layer_multiply_the_fp32_copies(monkeypatch) -> None:
    """On a bf16 CPU model a run of few rows (decode) multiplies the fp32 copies of the factors
    (faster there, docs/performance.md); a long run (prefill) the bf16 ones. The torch path
    (the segmented kernel's fallback; the kernel is checked in test_lora_kernel.py)."""
    monkeypatch.setattr(lora, "segmented_update", lambda *args: False)

    class Host(LoRAHost):
        def __init__(self) -> None:
            self.init_lora()

    torch.manual_seed(0)
    a, b = torch.randn(4, 32), torch.randn(24, 4)
    host = Host()
    host.lora_blocks[1] = (LoRABlock(a.bfloat16(), b.bfloat16(), 8, 32, a, b),)
    for num_rows, fp32 in [(SMALL_RUN_ROWS - 1, True), (SMALL_RUN_ROWS, False)]:
        x = torch.randn(num_rows, 32).bfloat16()
        with lora_context(LoRABatch((LoRAGroup(1, 0, None),))):
            out = host.add_lora(x, torch.zeros(num_rows, 32, dtype=torch.bfloat16))
        if fp32:
            expected = F.linear(F.linear(x.float(), a), b).bfloat16()
        else:
            expected = F.linear(F.linear(x, a.bfloat16()), b.bfloat16())
        assert torch.equal(out[:, 8:], expected) and not out[:, :8].any()
