"""Gemma 3 against transformers and sentence-transformers, on tiny random models:
``Gemma3ForCausalLM`` logits (paged chunks and decodes past the window, soft-capping) and greedy
generation through ``LLM``; ``Gemma3TextModel`` as the EmbeddingGemma encoder (bidirectional
sliding window, Dense stack, prompts) and as a causal trunk."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from factories.decoders import save_generation_decoder
from factories.generation import hf_greedy, make_llm, random_prompts, token_prompts
from factories.seeded import perturb, random_model
from factories.texts import random_prompts as random_ids
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from cenote import PoolingParams, SamplingParams
from cenote.forward_context import AttentionMetadata, forward_context
from cenote.models.config_reader import read_model_config
from cenote.models.layers.attention import kv_cache_shape
from cenote.models.loader import load_model

NUM_THREADS = 2
ATOL = 1e-4  # DESIGN.md §3: logits / hidden states vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance, fp32
BLOCK_SIZE = 4
_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    query_pre_attn_scalar=24,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
    },
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# name -> config overrides of the causal LM
CAUSAL_VARIANTS: dict[str, dict] = {
    # local + global layers with their own RoPE, logits soft-capped, tied LM head
    "mixed": dict(sliding_window=5, final_logit_softcapping=30.0),
    # every layer slides (KV blocks behind the window are freed); attn_logit_softcapping is
    # configured but transformers' Gemma 3 never applies it (eager nor SDPA): neither do we
    "all_sliding": dict(
        sliding_window=5,
        layer_types=["sliding_attention"] * 3,
        attn_logit_softcapping=20.0,
        tie_word_embeddings=False,
    ),
}


def make_gemma3_causal(folder: Path, seed: int = 0, **overrides) -> torch.nn.Module:
    """Noise on every parameter (the zero-centred norm weights too), so misplaced weights show."""
    config = transformers.Gemma3TextConfig(**{**_SMALL, **overrides})
    return save_generation_decoder(folder, random_model("Gemma3ForCausalLM", config, seed))


@pytest.fixture(scope="module", params=sorted(CAUSAL_VARIANTS))
def causal(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp(request.param)
    theirs = make_gemma3_causal(folder, **CAUSAL_VARIANTS[request.param])
    ours = load_model(read_model_config(folder, dtype="float32"))
    return request.param, ours, theirs


# (request, first token, end token) per step: prefills past the window, a chunk after cached
# context, lone and batched decodes
STEPS = [
    [(0, 0, 9), (1, 0, 3)],
    [(0, 9, 12), (1, 3, 4)],
    [(0, 12, 13), (1, 4, 5)],
    [(0, 13, 14), (1, 5, 11)],
]
BLOCK_TABLES = [[0, 5, 2, 7], [3, 1, 6]]


def _step_metadata(step, kv_caches, window: int | None) -> AttentionMetadata:
    """With ``window`` (every layer slides), blocks behind the window of the step's first query
    are -1 in the table, as the KV manager leaves them."""
    loc, slots, tables = [0], [], []
    for request, start, end in step:
        loc.append(loc[-1] + end - start)
        table = list(BLOCK_TABLES[request])
        slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
        if window is not None:
            first_visible = max(0, start - window + 1) // BLOCK_SIZE
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


def test_paged_logits_match_transformers(causal) -> None:
    variant, ours, theirs = causal
    assert ours.kv_sliding_window == (5 if variant == "all_sliding" else None)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator) for n in (14, 11)]
    with torch.no_grad():
        expected = [theirs(p.unsqueeze(0)).logits[0].float() for p in prompts]
    kv_caches = [
        torch.zeros(kv_cache_shape(8, BLOCK_SIZE, ours.num_kv_heads, ours.head_dim))
        for _ in range(ours.num_layers)
    ]
    for step in STEPS:
        input_ids = torch.cat([prompts[r][s:e] for r, s, e in step])
        positions = torch.cat([torch.arange(s, e) for _, s, e in step])
        metadata = _step_metadata(step, kv_caches, ours.kv_sliding_window)
        with torch.no_grad(), forward_context(metadata):
            logits = ours.compute_logits(ours(input_ids, positions))
        offset = 0
        for request, start, end in step:
            got = logits[offset : offset + end - start]
            torch.testing.assert_close(got, expected[request][start:end], atol=ATOL, rtol=0)
            offset += end - start


def test_flat_batch_without_cache_matches_transformers(causal) -> None:
    _, ours, theirs = causal
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


def test_greedy_past_the_window_matches_transformers(tmp_path: Path) -> None:
    # untied: with a tied head a random Gemma repeats its last token (the scaled embedding
    # dominates the residual stream), which would prove little
    theirs = make_gemma3_causal(tmp_path, seed=2, sliding_window=8, tie_word_embeddings=False)
    prompts = random_prompts([3, 10, 21], seed=4)
    expected = hf_greedy(theirs, prompts, 24)
    assert all(len(set(tokens)) > 8 for tokens in expected)
    llm = make_llm(tmp_path, block_size=BLOCK_SIZE)
    assert llm.engine.kv_cache_manager.sliding_window is None  # the global layer reads them all
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for prompt, tokens in zip(prompts, expected, strict=True):
        (out,) = llm.generate(token_prompts([prompt]), params, use_tqdm=False)
        assert out.outputs[0].token_ids == tokens
    outs = llm.generate(token_prompts(prompts), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected


def test_unknown_rope_type_is_refused_with_the_supported_list(tmp_path: Path) -> None:
    make_gemma3_causal(tmp_path, sliding_window=5)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "factor": 8.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'yarn' is not supported; supported: default, linear"):
        load_model(read_model_config(tmp_path, dtype="float32"))


# ---- attention soft-capping (Gemma 2 style), as transformers' eager attention -----------------


def test_attention_softcap_matches_transformers_eager() -> None:
    """The paged and cache-free paths with ``softcap`` (and a window) against transformers'
    eager attention with ``softcap`` (Gemma 2's, which applies it)."""
    from types import SimpleNamespace

    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

    from cenote.models.layers.attention import Attention

    heads, kv_heads, dim, length, window, scale = 4, 2, 16, 12, 5, 24**-0.5
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(length, heads * dim, generator=generator) * 2
    k = torch.randn(length, kv_heads * dim, generator=generator) * 2
    v = torch.randn(length, kv_heads * dim, generator=generator)
    positions = torch.arange(length)
    distance = positions.unsqueeze(1) - positions.unsqueeze(0)
    allowed = (distance >= 0) & (distance < window)
    mask = torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, head_dim=dim, training=False)
    expected, _ = eager_attention_forward(
        module,
        q.view(1, length, heads, dim).transpose(1, 2),
        k.view(1, length, kv_heads, dim).transpose(1, 2),
        v.view(1, length, kv_heads, dim).transpose(1, 2),
        mask[None, None],
        scaling=scale,
        softcap=20.0,
    )
    expected = expected[0].reshape(length, heads * dim)  # [length, heads * dim]
    attention = Attention(heads, dim, kv_heads, 0, scale, sliding_window=window, softcap=20.0)
    without_cache = AttentionMetadata([0, length], [length], causal=True)
    with forward_context(without_cache):
        torch.testing.assert_close(attention(q, k, v), expected, atol=1e-5, rtol=0)
    kv_caches = [torch.zeros(kv_cache_shape(4, BLOCK_SIZE, kv_heads, dim))]
    table = [2, 0, 3]
    for start, end in [(0, 7), (7, 10), (10, 11), (11, 12)]:  # prefill, chunk, decodes
        metadata = AttentionMetadata(
            [0, end - start],
            [end],
            causal=True,
            slot_mapping=torch.tensor(
                [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(start, end)]
            ),
            block_tables=[table],
            block_size=BLOCK_SIZE,
            kv_caches=kv_caches,
        )
        with forward_context(metadata):
            got = attention(q[start:end], k[start:end], v[start:end])
        torch.testing.assert_close(got, expected[start:end], atol=1e-5, rtol=0)


# ---- EmbeddingGemma: Gemma3TextModel as an encoder -------------------------------------------

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]
WORDS = ["task", ":", "search", "result", "|", "query", "title", "none", "text"]
WORDS += ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "far", "away", "and", "home"]
PROMPTS = {"query": "task: search result | query: ", "document": "title: none | text: "}
TEXTS = [
    "the cat sat",
    "a dog ran far away",
    "cat",
    " ".join(["the cat sat on a mat and the dog ran home"] * 3),  # well past the window
    "home and away",
]


def write_gemma_tokenizer(folder: Path, vocab_size: int) -> None:
    """WordLevel ``<bos> $A <eos>`` tokenizer (as EmbeddingGemma's adds both) that
    transformers, sentence-transformers and cenote load."""
    vocab = {token: i for i, token in enumerate(SPECIALS + WORDS)}
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 2), ("<eos>", 1)]
    )
    tokenizer.add_special_tokens(SPECIALS)
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    fast.save_pretrained(folder)


def make_gemma3_encoder(folder: Path, bidirectional: bool, seed: int = 0) -> torch.nn.Module:
    """A Gemma3TextModel trunk (window 6: bidirectional layers see 3 tokens either side)."""
    config = transformers.Gemma3TextConfig(
        **{**_SMALL, "bos_token_id": 2, "eos_token_id": 1},
        sliding_window=6,
        use_bidirectional_attention=bidirectional,
    )
    model = perturb(transformers.Gemma3TextModel(config), seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_gemma_tokenizer(folder, config.vocab_size)
    return model


@pytest.fixture(scope="module")
def embedding_gemma(tmp_path_factory: pytest.TempPathFactory):
    """EmbeddingGemma's layout at toy size, saved by sentence-transformers: trunk -> mean pooling
    -> Dense(64, 96) -> Dense(96, 32), no biases -> Normalize, with query/document prompts."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    root = tmp_path_factory.mktemp("embeddinggemma")
    trunk_model = make_gemma3_encoder(root / "trunk", bidirectional=True, seed=3)
    torch.manual_seed(7)
    modules = [
        Transformer(str(root / "trunk"), max_seq_length=64),
        Pooling(64, pooling_mode="mean"),
        Dense(64, 96, bias=False, activation_function=torch.nn.Identity()),
        Dense(96, 32, bias=False, activation_function=torch.nn.Identity()),
        Normalize(),
    ]
    st_model = SentenceTransformer(modules=modules, prompts=PROMPTS, device="cpu")
    st_model.save(str(root / "st"))
    torch.set_num_threads(NUM_THREADS)
    reloaded = SentenceTransformer(str(root / "st"), device="cpu").float().eval()
    llm = make_llm(root / "st")
    return llm, reloaded, trunk_model, root / "trunk"


def test_embedding_gemma_matches_sentence_transformers(embedding_gemma) -> None:
    llm, st_model, _, _ = embedding_gemma
    assert llm.engine.kv_cache_manager is None  # an encoder: no KV cache, prompts whole
    for name, prompt in PROMPTS.items():
        theirs = st_model.encode(TEXTS, prompt_name=name, convert_to_tensor=True).float()
        outputs = llm.embed([prompt + text for text in TEXTS], use_tqdm=False)
        ours = torch.stack([out.outputs.data.float() for out in outputs])
        assert ours.shape == theirs.shape == (len(TEXTS), 32)
        cos = F.cosine_similarity(ours, theirs, dim=-1)
        assert cos.min() >= MIN_COSINE_FP32, f"{name}: min cosine {cos.min():.6f}"
        # the same tokens as sentence-transformers
        features = st_model.preprocess([prompt + text for text in TEXTS])
        for out, ids, mask in zip(
            outputs, features["input_ids"], features["attention_mask"], strict=True
        ):
            assert out.prompt_token_ids == ids[mask.bool()].tolist()
    # the window bites: the long text is longer than the layers see
    assert len(outputs[3].prompt_token_ids) > 3 * 6


def test_embedding_gemma_hidden_states_match_transformers(embedding_gemma) -> None:
    _, _, trunk, trunk_folder = embedding_gemma
    llm = make_llm(trunk_folder)  # the trunk alone: token_embed is its hidden states
    prompts = random_ids([30, 4, 17, 17], seed=8, low=len(SPECIALS), high=256)
    outputs = llm.encode(
        token_prompts(prompts),
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = trunk(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(out.outputs.data.float(), expected, atol=ATOL, rtol=0)


def test_embedding_gemma_batch_invariance(embedding_gemma) -> None:
    llm, _, _, _ = embedding_gemma
    texts = [PROMPTS["document"] + text for text in TEXTS]
    batched = torch.stack([o.outputs.data for o in llm.embed(texts, use_tqdm=False)])
    alone = torch.stack([llm.embed([text], use_tqdm=False)[0].outputs.data for text in texts])
    torch.testing.assert_close(batched, alone, atol=BATCH_ATOL, rtol=0)


def test_causal_gemma3_text_model_matches_transformers(tmp_path: Path) -> None:
    """Without use_bidirectional_attention the trunk stays causal when served as an encoder."""
    trunk = make_gemma3_encoder(tmp_path, bidirectional=False, seed=4)
    llm = make_llm(tmp_path)
    prompts = random_ids([15, 3, 9], seed=9, low=len(SPECIALS), high=256)
    outputs = llm.encode(
        token_prompts(prompts),
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = trunk(torch.tensor([prompt])).last_hidden_state[0]
        torch.testing.assert_close(out.outputs.data.float(), expected, atol=ATOL, rtol=0)


def test_older_config_keys_match_transformers() -> None:
    """Hub configs before transformers 5 (Gemma 3 4B, EmbeddingGemma): ``rope_theta`` +
    ``rope_scaling`` for global layers, ``rope_local_base_freq`` for local ones, and
    ``sliding_window_pattern`` instead of ``layer_types``."""
    from cenote.models.gemma3 import gemma3_layer_types, gemma3_rope_parameters
    from cenote.models.layers.rotary import RotaryEmbedding

    old = {
        **{k: v for k, v in _SMALL.items() if k not in ("layer_types", "rope_parameters")},
        "num_hidden_layers": 8,
        "sliding_window": 16,
        "sliding_window_pattern": 4,
        "rope_theta": 500000.0,
        "rope_local_base_freq": 5000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    }
    hf_config = transformers.Gemma3TextConfig(**old)
    assert gemma3_layer_types(old) == hf_config.layer_types
    rope = gemma3_rope_parameters(old)
    reference = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(hf_config)
    for kind in ("sliding_attention", "full_attention"):
        ours = RotaryEmbedding(16, {**old, "rope_parameters": rope[kind]}).inv_freq
        torch.testing.assert_close(ours, getattr(reference, f"{kind}_inv_freq"), atol=0, rtol=1e-6)
