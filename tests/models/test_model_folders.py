"""Model folders as other tools write them, checked against those tools: a sharded safetensors
checkpoint (transformers ``save_pretrained``) against transformers' hidden states; a
sentence-transformers model with Dense projectors, Normalize and a default prompt, saved by
sentence-transformers itself, against ``SentenceTransformer.encode``; and priority scheduling
through the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers
from factories.encoders import TINY_ENCODER
from factories.seeded import hf_config, random_model
from factories.texts import random_prompts
from factories.vocab import BERT_SPECIALS, write_encoder_tokenizer_json, write_tokenizer

from cenote import LLM, PoolingParams

NUM_THREADS = 2
ATOL = 1e-4  # DESIGN.md §3: hidden states vs transformers, fp32
MIN_COSINE_FP32 = 0.9999  # DESIGN.md §3: embeddings vs sentence-transformers, fp32
_BERT = dict(TINY_ENCODER, pad_token_id=0)


def _random_bert(seed: int, **overrides) -> transformers.BertModel:
    """A seeded BertModel with noise on every parameter, so a misplaced weight shows."""
    return random_model("BertModel", hf_config("BertConfig", _BERT, overrides), seed)


# ---- 1. sharded safetensors -----------------------------------------------------------------


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("sharded")
    model = _random_bert(3, hidden_size=64, intermediate_size=128)
    model.save_pretrained(folder, max_shard_size="100KB")
    write_encoder_tokenizer_json(folder, BERT_SPECIALS, _BERT["vocab_size"])
    return folder, model


def test_sharded_checkpoint_matches_transformers_hidden_states(sharded) -> None:
    folder, model = sharded
    assert not (folder / "model.safetensors").exists()
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3, shards
    assert all((folder / shard).exists() for shard in shards)
    # every tensor lives in some shard, and the shards together hold all of the model
    assert set(index["weight_map"]) >= {name for name, _ in model.named_parameters()}

    prompts = random_prompts([5, 17, 1, 40], seed=7)
    llm = LLM(str(folder), dtype="float32", num_threads=NUM_THREADS)
    outputs = llm.encode(
        [{"prompt_token_ids": p} for p in prompts],
        PoolingParams(normalize=False),
        pooling_task="token_embed",
        use_tqdm=False,
    )
    torch.set_num_threads(NUM_THREADS)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).last_hidden_state[0]
        assert out.outputs.data.shape == expected.shape == (len(prompt), 64)
        torch.testing.assert_close(out.outputs.data.float(), expected, atol=ATOL, rtol=0)


# ---- 2. sentence-transformers: Dense, Normalize, default prompt --------------------------------

PROMPTS = {"query": "query : ", "passage": "document the "}
TEXTS = [
    "the cat sat",
    "a dog",
    "yes no yes",
    "the mat + the cat - a dog",
    "query document",
    "unknownword the",
    " ".join(["cat", "dog", "the", "mat"] * 30),  # over max_seq_length: truncated after the prompt
]
MAX_SEQ_LENGTH = 48


def _save_sentence_transformer(root: Path, activation: torch.nn.Module | None, seed: int) -> Path:
    """Trunk -> mean pooling -> Dense(32, 24[, Tanh]) -> Dense(24, 16, no bias) -> Normalize,
    with prompts and a default prompt, saved by sentence-transformers."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    trunk = root / "trunk"
    trunk.mkdir(parents=True)
    _random_bert(seed).save_pretrained(trunk)
    write_tokenizer(trunk, BERT_SPECIALS)
    torch.manual_seed(seed + 100)
    transformer = Transformer(str(trunk), max_seq_length=MAX_SEQ_LENGTH)
    pooling = Pooling(_BERT["hidden_size"], pooling_mode="mean")
    first = Dense(32, 24, activation_function=activation or torch.nn.Identity())
    second = Dense(24, 16, bias=False, activation_function=torch.nn.Identity())
    with torch.no_grad():  # biases start at zero: make them count
        first.linear.bias.normal_()
    model = SentenceTransformer(
        modules=[transformer, pooling, first, second, Normalize()],
        prompts=PROMPTS,
        default_prompt_name="passage",
        device="cpu",
    )
    folder = root / "st"
    model.save(str(folder))
    return folder


@pytest.fixture(scope="module", params=["tanh", "identity"])
def st_folder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    activation = torch.nn.Tanh() if request.param == "tanh" else None
    return _save_sentence_transformer(tmp_path_factory.mktemp(request.param), activation, seed=5)


def test_sentence_transformer_with_dense_and_default_prompt(st_folder: Path) -> None:
    from sentence_transformers import SentenceTransformer

    dense = json.loads((st_folder / "2_Dense" / "config.json").read_text())
    assert dense["out_features"] == 24
    settings = json.loads((st_folder / "config_sentence_transformers.json").read_text())
    assert settings["default_prompt_name"] == "passage"

    torch.set_num_threads(NUM_THREADS)
    st_model = SentenceTransformer(str(st_folder), device="cpu").float().eval()
    assert st_model.default_prompt_name == "passage"
    theirs = st_model.encode(TEXTS, convert_to_tensor=True).float()
    # the prompt matters: without it sentence-transformers gives other vectors
    plain = st_model.encode(TEXTS, prompt="", convert_to_tensor=True).float()
    assert F.cosine_similarity(theirs, plain, dim=-1).min() < 0.999

    llm = LLM(str(st_folder), dtype="float32", num_threads=NUM_THREADS)
    assert llm.config.model.max_model_len == MAX_SEQ_LENGTH
    outputs = llm.embed(TEXTS, truncate_prompt_tokens=-1, use_tqdm=False)
    ours = torch.stack([out.outputs.data.float() for out in outputs])
    assert ours.shape == theirs.shape == (len(TEXTS), 16)
    cos = F.cosine_similarity(ours, theirs, dim=-1)
    worst = int(cos.argmin())
    assert cos.min() >= MIN_COSINE_FP32, f"min cosine {cos.min():.6f} on {TEXTS[worst]!r}"
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)), atol=1e-5, rtol=0)
    # the same tokens as sentence-transformers (default prompt prepended, then truncated)
    features = st_model.preprocess([PROMPTS["passage"] + t for t in TEXTS])
    for out, ids, mask in zip(
        outputs, features["input_ids"], features["attention_mask"], strict=True
    ):
        assert out.prompt_token_ids == ids[mask.bool()].tolist()


# ---- 3. priority scheduling through the engine -------------------------------------------------


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("priority")
    _random_bert(11).save_pretrained(folder)
    write_encoder_tokenizer_json(folder, BERT_SPECIALS, _BERT["vocab_size"])
    return folder


class _Driver:
    """Adds embedding requests through the LLM's own client and steps it by hand."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.finish_order: list[str] = []
        self.steps: list[list[str]] = []

    def add(self, request_id: str, prompt: list[int], priority: int) -> None:
        params = PoolingParams(task="embed", normalize=False)
        prompt_ids = {"prompt_token_ids": prompt}
        request = self.llm.input_processor.process(
            request_id, prompt_ids, params, priority=priority
        )
        self.llm.client.add([request])

    def run(self, steps: int | None = None) -> None:
        """Step until nothing is left (or ``steps`` times), noting the order requests finish."""
        while self.llm.client.num_unfinished and steps != 0:
            self.finish_order += [out.request_id for out in self.llm.client.outputs()]
            steps = None if steps is None else steps - 1


def _record_scheduled(llm: LLM, steps: list[list[str]]) -> None:
    scheduler = llm.engine.scheduler
    original = scheduler.schedule

    def schedule():
        output = original()
        steps.append([s.request_id for s in output.scheduled])
        return output

    scheduler.schedule = schedule


def test_priority_policy_runs_lowest_value_first_and_fcfs_among_equals(tiny_bert: Path) -> None:
    llm = LLM(
        str(tiny_bert),
        dtype="float32",
        num_threads=NUM_THREADS,
        scheduling_policy="priority",
        max_num_seqs=1,
    )
    driver = _Driver(llm)
    _record_scheduled(llm, driver.steps)
    submitted = [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", -3), ("f", 2), ("g", 1)]
    prompts = random_prompts([4 + i for i in range(len(submitted))], seed=21)
    for (request_id, priority), prompt in zip(submitted, prompts, strict=True):
        driver.add(request_id, prompt, priority)
    driver.run(steps=1)
    # a late arrival with the best priority overtakes everything still waiting
    driver.add("late", prompts[0], -1)
    driver.run()
    assert driver.finish_order == ["e", "late", "b", "d", "c", "g", "a", "f"]
    scheduled = [ids for ids in driver.steps if ids]
    assert all(len(ids) == 1 for ids in scheduled)  # max_num_seqs=1
    assert [ids[0] for ids in scheduled] == driver.finish_order


def test_fcfs_policy_ignores_priority(tiny_bert: Path) -> None:
    llm = LLM(str(tiny_bert), dtype="float32", num_threads=NUM_THREADS, max_num_seqs=1)
    driver = _Driver(llm)
    submitted = [("a", 2), ("b", 0), ("c", -1)]
    for (request_id, priority), prompt in zip(submitted, random_prompts([3, 4, 5]), strict=True):
        driver.add(request_id, prompt, priority)
    driver.run()
    assert driver.finish_order == ["a", "b", "c"]


def test_include_prompt_false_is_read(tmp_path: Path) -> None:
    """A pooling that leaves the prompt out (parity: tests/models/test_include_prompt.py)."""
    import json

    from cenote.models.formats.st_config import load_st_config

    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    config = {"word_embedding_dimension": 8, "pooling_mode": "mean", "include_prompt": False}
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    st_config = load_st_config(tmp_path)
    assert st_config.pooling == "mean" and st_config.include_prompt is False


def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path) -> None:
    """A config.json that disagrees with the checkpoint fails loudly, never by broadcasting."""
    import json

    _random_bert(5).save_pretrained(tmp_path)
    write_encoder_tokenizer_json(tmp_path, BERT_SPECIALS, _BERT["vocab_size"])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ValueError, match=r"intermediate.dense.* has shape \(64.*expects \(96"):
        LLM(str(tmp_path), dtype="float32")
