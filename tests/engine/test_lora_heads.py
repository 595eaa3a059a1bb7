"""LoRA adapters that save their own classification head (PEFT ``modules_to_save``), and the
host-memory cache of adapters (``--max-cpu-loras``); issue 31.

The reference is ``peft.PeftModel`` itself, loading the adapter folder it wrote over the tiny
random base: its head copy replaces ``classifier`` / ``score`` for that adapter's requests only.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pathlib import Path

import pytest
import torch
from factories.decoders import make_decoder, make_pooling_decoder
from factories.encoders import make_encoder_classifier
from factories.generation import hf_greedy, make_llm, random_prompts, token_prompts
from factories.lora import write_adapter, write_head_adapter

from cenote import LoRARequest, PoolingParams, SamplingParams
from cenote.config import LoRAConfig
from cenote.lora.manager import shape_checker

PROB_ATOL = 1e-5  # the brief: probabilities vs peft, fp32
BATCH_ATOL = 1e-5  # DESIGN.md §3: batch invariance in fp32
PROMPTS = [[7, 20, 33, 41, 9], [12, 5, 88], [30, 31, 32, 33, 34, 35, 36, 37, 38], [3, 4]]


# per encoder family: adapter -> (LoRA targets, modules_to_save). BERT's head is its tanh
# pooler + ``classifier``; RoBERTa's and XLM-R's ``classifier`` is dense -> tanh -> out_proj
ENCODERS = {
    "bert": {
        "head": (["query", "value"], ["classifier"]),
        "pooled": (["intermediate.dense"], ["classifier", "pooler"]),
    },
    "roberta": {
        "head": (["query", "value"], ["classifier"]),
        "pooled": (["intermediate.dense", "output.dense"], ["classifier"]),
    },
    "xlm-roberta": {
        "head": (["query", "key"], ["classifier"]),
        "pooled": (["intermediate.dense"], ["classifier"]),
    },
}


class Classifier:
    """A tiny random sequence classifier (3 labels) and two adapters with their own head:
    ``head`` (LoRA on attention + the classifier) and ``pooled`` (LoRA on the MLP + the
    classifier and, for BERT, the tanh pooler)."""

    def __init__(self, root: Path, family: str) -> None:
        self.root = root
        self.family = family
        if family in ENCODERS:
            self.base = make_encoder_classifier(
                root / "base", family, "ForSequenceClassification", num_labels=3
            )
            specs = ENCODERS[family]
        else:
            self.base = make_pooling_decoder(
                root / "base", family, "ForSequenceClassification", num_labels=3
            )
            specs = {
                "head": (["q_proj", "v_proj"], ["score"]),
                "pooled": (["gate_proj", "down_proj"], ["score"]),
            }
        self.references: dict[str | None, torch.nn.Module] = {None: self.base}
        self.adapters: dict[str, LoRARequest] = {}
        for i, (name, (targets, saved)) in enumerate(specs.items()):
            self.references[name] = write_head_adapter(
                self.base, root / name, 20 + i, targets, saved, r=4, lora_alpha=8
            )
            self.adapters[name] = LoRARequest(name, i + 1, str(root / name))
        self.llm = make_llm(root / "base")

    def probs(self, name: str | None, prompt: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return self.references[name](torch.tensor([prompt])).logits[0].float().softmax(-1)


@pytest.fixture(scope="module", params=["bert", "roberta", "xlm-roberta", "llama", "qwen2"])
def classifier(request, tmp_path_factory) -> Classifier:
    return Classifier(tmp_path_factory.mktemp(f"lora_head_{request.param}"), request.param)


def _classify(classifier: Classifier, prompts, adapters) -> list[torch.Tensor]:
    outputs = classifier.llm.classify(token_prompts(prompts), lora_request=adapters)
    return [out.outputs.data for out in outputs]


@pytest.mark.parametrize("name", [None, "head", "pooled"])
def test_probabilities_equal_peft(classifier: Classifier, name) -> None:
    adapter = None if name is None else classifier.adapters[name]
    for prompt, probs in zip(PROMPTS, _classify(classifier, PROMPTS, adapter), strict=True):
        expected = classifier.probs(name, prompt)
        torch.testing.assert_close(probs, expected, atol=PROB_ATOL, rtol=0)
        if name is not None:  # the adapter's head moves the answer: the test can tell
            assert (expected - classifier.probs(None, prompt)).abs().max() > 1e-2


def test_batch_mixing_heads_and_base_equals_each_alone(classifier: Classifier) -> None:
    """Two adapters' heads and the base head in one step: each request's probabilities are
    what it gets alone."""
    names = [None, "head", "pooled", "head", None, "pooled"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    adapters = [None if n is None else classifier.adapters[n] for n in names]
    mixed = _classify(classifier, prompts, adapters)
    for probs, prompt, adapter in zip(mixed, prompts, adapters, strict=True):
        (alone,) = _classify(classifier, [prompt], adapter)
        torch.testing.assert_close(probs, alone, atol=BATCH_ATOL, rtol=0)


def test_head_of_another_label_count_is_refused(classifier: Classifier, tmp_path) -> None:
    """An adapter whose head has 2 labels over a 3-label base names both shapes."""
    if classifier.family in ENCODERS:
        other = make_encoder_classifier(
            tmp_path / "two", classifier.family, "ForSequenceClassification", num_labels=2
        )
        spec = (["query"], ["classifier"])
    else:
        other = make_pooling_decoder(
            tmp_path / "two", classifier.family, "ForSequenceClassification", num_labels=2
        )
        spec = (["q_proj"], ["score"])
    write_head_adapter(other, tmp_path / "adapter", 3, spec[0], spec[1], r=4, lora_alpha=8)
    wrong = LoRARequest("two", 30, str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match=r"does not fit this base model.*\(2,.*\(3,"):
        _classify(classifier, PROMPTS[:1], wrong)
    # the server's front checks the same on a copy of the model on the meta device
    checker = shape_checker(classifier.llm.config.model, max_lora_rank=8)
    checker.check(classifier.adapters["pooled"])
    with pytest.raises(ValueError, match=r"does not fit this base model.*\(2,.*\(3,"):
        checker.check(wrong)
    (probs,) = _classify(classifier, PROMPTS[:1], None)  # the engine is alive
    torch.testing.assert_close(probs, classifier.probs(None, PROMPTS[0]), atol=PROB_ATOL, rtol=0)


def test_token_classifier_head_equals_peft_per_token(tmp_path) -> None:
    """A token classifier's saved ``classifier`` scores every row of its requests; a base
    request in the same call keeps the base head."""
    base = make_encoder_classifier(
        tmp_path / "base", "bert", "ForTokenClassification", num_labels=5
    )
    reference = write_head_adapter(
        base, tmp_path / "adapter", 5, ["query", "value"], ["classifier"], r=4, lora_alpha=8
    )
    llm = make_llm(tmp_path / "base")
    adapter = LoRARequest("tokens", 1, str(tmp_path / "adapter"))
    outputs = llm.encode(
        token_prompts(PROMPTS[:2]), pooling_task="token_classify", lora_request=[adapter, None]
    )
    for out, prompt, model in zip(outputs, PROMPTS[:2], [reference, base], strict=True):
        with torch.no_grad():
            expected = model(torch.tensor([prompt])).logits[0].float().softmax(-1)
        torch.testing.assert_close(out.outputs.data, expected, atol=PROB_ATOL, rtol=0)
    with torch.no_grad():  # the adapter's head moves the answer: the test can tell
        base_probs = base(torch.tensor([PROMPTS[0]])).logits[0].float().softmax(-1)
    assert (outputs[0].outputs.data - base_probs).abs().max() > 1e-2


def test_trunk_module_in_modules_to_save_is_refused(tmp_path) -> None:
    base = make_encoder_classifier(tmp_path / "base", "bert", "ForSequenceClassification")
    write_head_adapter(
        base, tmp_path / "adapter", 3, ["query"], ["attention.output.dense"], r=4, lora_alpha=8
    )
    llm = make_llm(tmp_path / "base")
    with pytest.raises(ValueError, match="not part of BertForSequenceClassification's"):
        llm.classify(["a b"], lora_request=LoRARequest("trunk", 1, str(tmp_path / "adapter")))
    assert llm.classify(["a b"])[0].outputs.probs  # the engine is alive


def test_lm_head_in_modules_to_save_is_refused(tmp_path) -> None:
    """A full LM-head copy would need per-row vocabulary projections: refused by name."""
    base = make_decoder(tmp_path / "base", "qwen2")  # untied: lm_head is its own module
    write_head_adapter(base, tmp_path / "adapter", 3, ["q_proj"], ["lm_head"], r=4, lora_alpha=8)
    llm = make_llm(tmp_path / "base")
    params = SamplingParams(max_tokens=2, temperature=0)
    adapter = LoRARequest("lm", 1, str(tmp_path / "adapter"))
    with pytest.raises(ValueError, match=r"\['lm_head'\].*an LM head copy is not supported"):
        llm.generate(token_prompts(PROMPTS[:1]), params, lora_request=adapter)
    (out,) = llm.generate(token_prompts(PROMPTS[:1]), params)  # the engine is alive
    assert out.outputs[0].token_ids == hf_greedy(base, PROMPTS[:1], 2)[0]


# ---- --max-cpu-loras ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def decoder(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_cpu_cache")
    base = make_decoder(root / "base", "llama")
    merged = {}
    adapters = {}
    for i, name in enumerate(["a", "b", "c"]):
        merged[name] = write_adapter(base, root / name, 40 + i, ["q_proj", "v_proj"], r=4)
        adapters[name] = LoRARequest(name, i + 1, str(root / name))
    llm = make_llm(root / "base", max_loras=1, max_cpu_loras=2)
    return llm, adapters, merged


def test_max_cpu_loras_keeps_evicted_adapters_in_host_memory(decoder) -> None:
    """One resident slot, two host copies: an adapter evicted from the slot comes back without
    reading its folder; the least recently used host copy is dropped beyond two."""
    llm, adapters, merged = decoder
    manager = llm.engine.runner.lora
    prompt = random_prompts([9], seed=4)
    params = SamplingParams(max_tokens=4, temperature=0)
    reads = []
    for name in ["a", "b", "a", "c", "b", "a"]:
        (out,) = llm.generate(token_prompts(prompt), params, lora_request=adapters[name])
        assert out.outputs[0].token_ids == hf_greedy(merged[name], prompt, 4)[0]
        assert [r.lora_name for r in manager.resident] == [name]
        reads.append(manager.num_disk_reads)
    # a, b read; a from host; c read (b dropped: host held [b, a]); b read (a dropped); a read
    assert reads == [1, 2, 2, 3, 4, 5]
    assert [r.lora_name for r in manager.host_cached] == ["b", "a"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (dict(max_loras=4, max_cpu_loras=2), r"max_cpu_loras \(2\) must be at least max_loras"),
        (dict(max_loras=1, max_cpu_loras=0), r"max_cpu_loras \(0\) must be at least max_loras"),
    ],
)
def test_bad_max_cpu_loras_is_refused(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        LoRAConfig(**options)


def test_max_cpu_loras_on_the_command_line(decoder) -> None:
    import argparse

    from cenote.engine_args import EngineArgs

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, include={"max_loras", "max_cpu_loras"})
    args = parser.parse_args(["--max-loras", "3", "--max-cpu-loras", "1"])
    engine_args = EngineArgs.from_cli_args(args)
    assert (engine_args.max_loras, engine_args.max_cpu_loras) == (3, 1)
    folder = decoder[0].config.model.path
    with pytest.raises(ValueError, match=r"max_cpu_loras \(1\) must be at least max_loras \(3\)"):
        EngineArgs(model=str(folder), max_loras=3, max_cpu_loras=1).create_engine_config()


def test_pooling_params_reach_the_adapter_head(classifier: Classifier) -> None:
    """use_activation=False gives the adapter head's raw logits."""
    outputs = classifier.llm.classify(
        token_prompts(PROMPTS[:2]),
        PoolingParams(use_activation=False),
        lora_request=classifier.adapters["head"],
    )
    for out, prompt in zip(outputs, PROMPTS[:2], strict=True):
        with torch.no_grad():
            logits = classifier.references["head"](torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(out.outputs.data, logits, atol=1e-4, rtol=0)
