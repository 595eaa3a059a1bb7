"""Structured outputs in the engine (llguidance grammars, token masks): every output matches its
constraint, checked by references nobody here wrote (``jsonschema``, Python's ``re``), on a tiny
random decoder over a byte-level tokenizer (random weights write bytes at random: only the
grammar makes them write JSON) and on SmolLM2's GGUF; constrained rows leave the others of their
step untouched; bad constraints are refused with the reason."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from factories.decoders import make_byte_level_decoder
from factories.generation import make_llm, record_steps

from cenote import SamplingParams, StructuredOutputsParams
from cenote.errors import InvalidInputError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
NESTED = {
    "type": "object",
    "properties": {
        "point": {
            "type": "object",
            "properties": {
                "x": {"type": "integer", "minimum": -99, "maximum": 99},
                "y": {"type": "integer", "minimum": 0, "maximum": 9},
            },
            "required": ["x", "y"],
            "additionalProperties": False,
        },
        "kind": {"enum": ["circle", "square"]},
    },
    "required": ["point", "kind"],
    "additionalProperties": False,
}
# GBNF (llama.cpp's notation) and Lark (llguidance's) for one language, also a regex here
# (bounded: random weights would repeat an unbounded rule up to max_tokens)
LIST_GBNF = 'root ::= "(" num more? more? more? ")"\nmore ::= "," num\nnum ::= [0-9] | [1-9] [0-9]'
LIST_LARK = 'start: "(" NUM MORE? MORE? MORE? ")"\nMORE: "," NUM\nNUM: /[0-9]|[1-9][0-9]/'
LIST_RE = r"\((?:[0-9]|[1-9][0-9])(?:,(?:[0-9]|[1-9][0-9])){0,3}\)"


# prompts are ids 3-96: printable ASCII bytes of the byte-level vocabulary (a lone byte above
# 0x7F would decode with the output's first bytes)


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp("byte-llama")
    make_byte_level_decoder(folder, "llama", seed=5)
    return make_llm(folder, max_num_seqs=16)


def _params(constraint: dict, seed: int | None, **options) -> SamplingParams:
    options.setdefault("max_tokens", 200)
    temperature = 0.0 if seed is None else 1.0
    return SamplingParams(
        temperature=temperature,
        seed=seed,
        structured_outputs=StructuredOutputsParams(**constraint),
        **options,
    )


def _check(constraint: dict, text: str) -> None:
    """The output satisfies ``constraint``, by the reference checkers."""
    if "json" in constraint:
        jsonschema.validate(json.loads(text), constraint["json"])
    elif "json_object" in constraint:
        assert isinstance(json.loads(text), dict)
    elif "regex" in constraint:
        assert re.fullmatch(constraint["regex"], text), text
    elif "choice" in constraint:
        assert text in constraint["choice"]
    else:
        assert re.fullmatch(LIST_RE, text), text


# random weights would fill every gap JSON allows with whitespace: none between tokens here
CONSTRAINTS = [
    {"json": PERSON, "whitespace_pattern": ""},
    {"json": NESTED, "whitespace_pattern": " ?"},
    {"regex": r"[0-9]{3}-[a-z]{2,4}"},
    {"choice": ["yes", "no", "a.b", "c|d"]},
    {"grammar": LIST_GBNF},
    {"grammar": LIST_LARK},
]


def test_every_output_matches_its_constraint(llm):
    """Greedy and sampled rows, every kind of constraint, all in the same steps."""
    constraints = [c for c in CONSTRAINTS for _ in range(3)]
    seeds = [None, 11, 12] * len(CONSTRAINTS)
    params = [_params(c, s) for c, s in zip(constraints, seeds, strict=True)]
    prompts = [{"prompt_token_ids": [1, 40 + i, 70 + i]} for i in range(len(params))]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for constraint, output in zip(constraints, outputs, strict=True):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (constraint, completion.text)
        _check(constraint, completion.text)


def test_constrained_rows_leave_their_step_unchanged(llm):
    """A constrained and an unconstrained request decode together exactly as each does alone
    (greedy, token-identical), and they did share steps."""
    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    constrained = _params({"json": NESTED, "whitespace_pattern": ""}, None)
    prompts = [{"prompt_token_ids": [1, 50, 60, 70]}, {"prompt_token_ids": [1, 80, 90]}]
    alone = [
        llm.generate([prompts[0]], [plain], use_tqdm=False)[0],
        llm.generate([prompts[1]], [constrained], use_tqdm=False)[0],
    ]
    steps = record_steps(llm)
    together = llm.generate(prompts, [plain, constrained], use_tqdm=False)
    assert any(len(step.scheduled) == 2 for step in steps)
    for a, b in zip(alone, together, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    _check({"json": NESTED}, together[1].outputs[0].text)


def test_constrained_plain_and_pooling_rows_in_one_step(llm):
    """A constrained decode, a plain decode and an embedding prefill in the same step each give
    what they give alone (tokens identical; the embedding within 1e-5); the constrained prompt
    run again is served from the prefix cache and writes the same tokens."""
    import torch

    from cenote import PoolingParams

    plain = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    constrained = _params({"json": NESTED, "whitespace_pattern": ""}, None)
    raw = PoolingParams(normalize=False)
    prompts = [{"prompt_token_ids": [1, *range(30, 70)]}, {"prompt_token_ids": [1, 80, 90]}]
    embed_prompt = {"prompt_token_ids": [1, *range(50, 62)]}
    alone = [
        llm.generate([p], [q], use_tqdm=False)[0]
        for p, q in zip(prompts, [constrained, plain], strict=True)
    ]
    embedding = llm.embed([embed_prompt], raw, use_tqdm=False)[0].outputs.data

    steps = record_steps(llm)
    ids = ["constrained", "plain"]
    finished: dict = {}  # outputs of requests that finished while the test stepped the engine

    def step() -> None:
        finished.update({o.request_id: o for o in llm.client.outputs() if o.finished})

    llm.client.add(llm.input_processor.process_batch(ids, prompts, [constrained, plain]))
    for _ in range(20):  # until both decode (the grammar compiles on its own thread)
        step()
        if {s.request_id for s in steps[-1].scheduled if s.needs_sample} == set(ids):
            break
    embed = raw.with_task("embed")
    llm.client.add(llm.input_processor.process_batch(["embed"], [embed_prompt], [embed]))
    step()
    kinds = {s.request_id: s for s in steps[-1].scheduled}
    assert set(kinds) == {*ids, "embed"}, kinds
    assert kinds["constrained"].grammar is not None and kinds["constrained"].grammar.active
    rest = [i for i in [*ids, "embed"] if i not in finished]
    finished.update(zip(rest, llm.client.wait(rest), strict=True))
    together = [finished[i] for i in [*ids, "embed"]]
    for a, b in zip(alone, together[:2], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    torch.testing.assert_close(together[2].outputs.data, embedding, atol=1e-5, rtol=0)
    _check({"json": NESTED}, together[0].outputs[0].text)

    again = llm.generate([prompts[0]], [constrained], use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_the_grammar_ends_the_request(llm):
    """A complete grammar finishes its request ("stop"), past ignore_eos, and before max_tokens;
    min_tokens cannot push it past the grammar's end."""
    choice = {"choice": ["yes", "no"]}
    for options in ({"ignore_eos": True}, {"min_tokens": 8}):
        output = llm.generate(
            [{"prompt_token_ids": [1, 44]}], [_params(choice, None, max_tokens=50, **options)],
            use_tqdm=False,
        )[0].outputs[0]  # fmt: skip
        assert output.finish_reason == "stop"
        assert output.text in choice["choice"]
        assert len(output.token_ids) <= 4


def test_n_children_and_preempted_requests_keep_their_grammar(tmp_path: Path):
    """n > 1 children each follow the grammar; requests preempted (a KV cache too small for all
    of them) recompute and go on matching."""
    make_byte_level_decoder(tmp_path, "qwen3", seed=2)
    llm = make_llm(
        tmp_path, max_num_seqs=8, block_size=4, num_gpu_blocks_override=64, max_model_len=256
    )
    steps = record_steps(llm)
    person, nested = (
        {"json": PERSON, "whitespace_pattern": ""},
        {"json": NESTED, "whitespace_pattern": ""},
    )
    params = [_params(person, 7, n=3, max_tokens=200), _params({"grammar": LIST_GBNF}, 8, n=3)]
    prompts = [{"prompt_token_ids": [1, *range(30, 50)]}, {"prompt_token_ids": [1, *range(60, 80)]}]
    params += [_params(nested, 9 + i, max_tokens=200) for i in range(4)]
    prompts += [{"prompt_token_ids": [1, *range(40 + i, 60 + i)]} for i in range(4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert any(step.preempted_request_ids for step in steps), "nothing was preempted"
    kinds = [{"json": PERSON}, {"grammar": LIST_GBNF}] + [{"json": NESTED}] * 4
    for kind, output in zip(kinds, outputs, strict=True):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", completion.text
            _check(kind, completion.text)
    assert [len(o.outputs) for o in outputs] == [3, 3, 1, 1, 1, 1]


@pytest.mark.parametrize(
    ("constraint", "message"),
    [
        ({}, "exactly one of"),
        ({"regex": "a", "choice": ["b"]}, "got 2 (regex, choice)"),
        ({"json": {"type": "string", "format": "no-such-format"}}, "Unknown format"),
        ({"json": "{not json"}, "json is not valid JSON"),
        ({"json": "[1, 2]"}, "must be a JSON schema object"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "root ::= missing"}, "GBNF grammar is invalid"),
        ({"grammar": "start: missing"}, 'unknown name: "missing"'),
        ({"choice": []}, "at least one string"),
        ({"regex": "a" * (1 << 18 | 1)}, "262145 characters, at most 262144"),
    ],
)
def test_bad_constraints_are_refused_with_the_reason(constraint, message):
    with pytest.raises(InvalidInputError, match=re.escape(message)):
        StructuredOutputsParams(**constraint)


def test_the_engine_serves_on_after_refusals(llm):
    """A refused constraint never reaches the engine; the next requests run as before."""
    with pytest.raises(InvalidInputError):
        _params({"regex": "(("}, None)
    output = llm.generate([{"prompt_token_ids": [1, 9]}], [_params({"regex": "[ab]{4}"}, None)])
    assert re.fullmatch("[ab]{4}", output[0].outputs[0].text)


def test_smollm2_writes_json_that_validates():
    """The real model (SmolLM2 GGUF, byte-level BPE from the file's metadata), greedy and
    sampled: outputs validate against the schema, and a choice picks a listed label."""
    from factories.generation import smollm2_path

    from cenote import LLM

    llm = LLM(str(smollm2_path()), max_num_seqs=8, num_threads=2)
    messages = [
        [{"role": "user", "content": "Describe a fictional person as JSON."}],
        [{"role": "user", "content": "Give me a circle at (1, 2) as a JSON object."}],
        [{"role": "user", "content": "Is 'I love this film' positive or negative?"}],
    ]
    constraints = [{"json": PERSON}, {"json": NESTED}, {"choice": ["positive", "negative"]}]
    for seed in (None, 3):
        params = [_params(c, seed, max_tokens=160) for c in constraints]
        outputs = llm.chat(messages, params, use_tqdm=False)
        for constraint, output in zip(constraints, outputs, strict=True):
            assert output.outputs[0].finish_reason == "stop"
            _check(constraint, output.outputs[0].text)


def test_the_constraint_can_start_after_given_tokens(llm):
    """``start_after_token_ids`` (a reasoning model's end of thinking): tokens before them are
    free, the output after them matches. logit_bias forces "!" (id 3) first; the JSON grammar
    alone would never allow it there."""
    constraint = {"json": NESTED, "whitespace_pattern": "", "start_after_token_ids": [3]}
    params = _params(constraint, None, logit_bias={3: 100.0})
    text = llm.generate([{"prompt_token_ids": [1, 50]}], [params], use_tqdm=False)[0]
    completion = text.outputs[0]
    assert completion.finish_reason == "stop"
    assert completion.token_ids[0] == 3 and completion.text[0] == "!"
    jsonschema.validate(json.loads(completion.text[1:]), NESTED)
    with pytest.raises(InvalidInputError, match="must not be empty"):
        StructuredOutputsParams(regex="a", start_after_token_ids=[])


def test_json_object_and_closed_objects_accept_what_they_say():
    """``json_object``: any JSON object, nothing else; ``disable_additional_properties``: an
    object that does not say closes (its listed keys only), one that says stays open; the
    JSON texts run through llguidance's matcher on a one-byte-per-token tokenizer."""
    from llguidance import LLMatcher, LLTokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    bytes_only = Tokenizer(models.BPE(vocab={**vocab, "<eos>": len(vocab)}, merges=[]))
    bytes_only.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bytes_only.decoder = decoders.ByteLevel()
    tokenizer = LLTokenizer(bytes_only.to_str(), eos_token=len(vocab))

    def accepts(params: StructuredOutputsParams, value) -> bool:
        matcher = LLMatcher(tokenizer, params.to_grammar())
        ids = tokenizer.tokenize_str(json.dumps(value, separators=(",", ":")))
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    any_object = StructuredOutputsParams(json_object=True)
    assert accepts(any_object, {"a": [1, {"b": None}]}) and accepts(any_object, {})
    assert not accepts(any_object, [1]) and not accepts(any_object, "x")
    schema = {"type": "object", "properties": {"a": {"type": "integer"},
              "open": {"type": "object", "additionalProperties": True}}}  # fmt: skip
    closed = StructuredOutputsParams(json=schema, disable_additional_properties=True)
    loose = StructuredOutputsParams(json=schema)
    extra = {"a": 1, "b": 2}
    assert accepts(closed, {"a": 1, "open": {"x": 1}}) and not accepts(closed, extra)
    assert accepts(loose, extra)


@pytest.mark.parametrize("implementation", ["numpy", "kernel"])
@pytest.mark.parametrize("vocab_size", [320, 331, 300, 400])
def test_masking_by_bitmask_words_equals_the_unpacked_mask(vocab_size, implementation):
    """``apply_allowed_tokens`` (empty / full / mixed 32-token words, a partial last word,
    logits wider or narrower than the bitmask), in numpy and on the C++ kernel, against numpy's
    unpacked bits; a row that the other masks left empty takes the grammar's mask over its
    unmasked logits; a NaN or +inf allowed logit does not count as a kept one."""
    import numpy as np
    import torch

    from cenote.kernels import quant_ops
    from cenote.sampling.metadata import AllowedTokens
    from cenote.sampling.sampler import (
        apply_allowed_tokens,
        mask_allowed,
        numpy_mask_allowed,
    )

    if implementation == "kernel" and quant_ops() is None:
        pytest.skip("C++ kernels not buildable")
    mask = numpy_mask_allowed if implementation == "numpy" else mask_allowed

    rng = np.random.default_rng(vocab_size)
    num_words = 10  # 320 tokens of bitmask
    words = rng.integers(-(2**31), 2**31, size=(4, num_words), dtype=np.int64).astype(np.int32)
    words[0, ::2], words[1, 1::3], words[2, :] = 0, -1, 0
    words[2, 3] = 1 << 5  # one allowed token in the row
    source = torch.randn(5, vocab_size)
    logits = source.clone()
    logits[3] = float("-inf")  # row 3: the other masks banned every token
    logits[4] = float("nan")  # row 4: nothing finite left either (NaN, +inf)
    logits[4, 1] = float("inf")
    rows = [0, 1, 3, 4]
    apply_allowed_tokens(logits, AllowedTokens(rows, torch.from_numpy(words)), source, mask)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little").astype(bool)
    for i, row in enumerate(rows):
        allowed = np.zeros(vocab_size, dtype=bool)
        width = min(vocab_size, bits.shape[1])
        allowed[:width] = bits[i, :width]
        expected = torch.where(torch.from_numpy(allowed), source[row], float("-inf"))
        assert torch.equal(logits[row], expected), (row, vocab_size)
    assert torch.equal(logits[2], source[2])  # unconstrained rows untouched
