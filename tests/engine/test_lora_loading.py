"""Reading a LoRA adapter's folder never blocks the engine loop (issue 31 item 4).

A request whose adapter is neither resident nor in host memory waits outside the scheduler
while ``LoRAManager.prefetch`` reads the folder on its reader thread; the running streams keep
decoding; the adapter is placed between steps and the request joins the scheduler. The reads are
held by a ``threading.Event`` the test releases, so "the stream decoded while the read was
pending" is counted in steps, not timed. References: peft's merged model run by transformers.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from factories.decoders import make_decoder
from factories.generation import hf_greedy, make_llm, random_prompts, token_prompts
from factories.lora import write_adapter

from cenote import LoRARequest, SamplingParams
from cenote.engine.output_processor import RequestFailure
from cenote.errors import RequestRejectedError
from cenote.lora import manager

MAX_NEW = 8
STREAM_TOKENS = 24  # the running stream: long enough to decode through a pending read
READ_WAIT_SECONDS = 30  # a gated read gives up (and fails its request) instead of hanging


class Base:
    """A tiny Llama base and three adapters written by peft, each with its merged model."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.model = make_decoder(root / "base", "llama")
        self.merged: dict[str | None, torch.nn.Module] = {None: self.model}
        specs = {
            "all": dict(targets=["q_proj", "k_proj", "v_proj", "o_proj"], r=4, lora_alpha=8),
            "qv": dict(targets=["q_proj", "v_proj"], r=8, lora_alpha=4),
            "mlp": dict(targets=["gate_proj", "up_proj", "down_proj"], r=2, lora_alpha=16),
        }
        for i, (name, spec) in enumerate(specs.items()):
            spec = dict(spec)
            targets = spec.pop("targets")
            self.merged[name] = write_adapter(self.model, root / name, 20 + i, targets, **spec)
        self.prompts = random_prompts([5, 9, 13, 7], seed=11)
        self._expected: dict[tuple[int, str | None], list[int]] = {}

    def adapter(self, name: str, lora_int_id: int) -> LoRARequest:
        return LoRARequest(name, lora_int_id, str(self.root / name))

    def expected(self, prompt_index: int, name: str | None) -> list[int]:
        """peft's merged model's greedy tokens (cached: many requests share them)."""
        key = (prompt_index, name)
        if key not in self._expected:
            prompt = self.prompts[prompt_index]
            self._expected[key] = hf_greedy(self.merged[name], [prompt], MAX_NEW)[0]
        return self._expected[key]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    return Base(tmp_path_factory.mktemp("lora_loading"))


@pytest.fixture(scope="module")
def llm(base: Base):
    return make_llm(base.root / "base", max_lora_rank=8, max_loras=2, num_gpu_blocks_override=256)


class Gate:
    """``read_adapter`` held until ``release``: ``started`` says a read is waiting."""

    def __init__(self, monkeypatch) -> None:
        self.started = threading.Event()
        self.released = threading.Event()
        original = manager.read_adapter

        def gated_read(*args, **kwargs):
            self.started.set()
            if not self.released.wait(READ_WAIT_SECONDS):
                raise TimeoutError("the test never released the read")
            return original(*args, **kwargs)

        monkeypatch.setattr(manager, "read_adapter", gated_read)

    def release(self) -> None:
        self.released.set()


def _add(llm, request_id: str, prompt: list[int], adapter: LoRARequest | None, max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    (parent,) = llm.input_processor.process_batch(
        [request_id], token_prompts([prompt]), params, lora_request=adapter
    )
    llm.client.add([parent])


def _finish(llm, pending: set[str], between_steps=None) -> dict:
    """Step until every request of ``pending`` finished (or failed); their last outputs."""
    finished = {}
    for _ in range(500):
        if not pending:
            return finished
        if between_steps is not None:
            between_steps()
        for output in llm.client.outputs():
            if output.finished and output.request_id in pending:
                pending.discard(output.request_id)
                finished[output.request_id] = output
    raise AssertionError(f"requests never finished: {sorted(pending)}")


def _tokens(output) -> list[int]:
    assert not isinstance(output, RequestFailure), output.error
    return list(output.outputs[0].token_ids)


def test_a_pending_read_does_not_stall_the_running_stream(base: Base, llm, monkeypatch) -> None:
    engine = llm.engine
    _add(llm, "stream", base.prompts[0], None, STREAM_TOKENS)
    llm.client.outputs()  # prefill
    stream = engine.scheduler.requests["stream"]
    gate = Gate(monkeypatch)
    adapter = base.adapter("all", 101)
    _add(llm, "adapted", base.prompts[1], adapter, MAX_NEW)
    assert gate.started.wait(READ_WAIT_SECONDS)
    before = stream.num_output_tokens
    for _ in range(4):  # the read is pending: the stream decodes a token each step
        llm.client.outputs()
    assert stream.num_output_tokens == before + 4
    assert "adapted" not in engine.scheduler.requests
    assert adapter.lora_int_id not in [r.lora_int_id for r in engine.runner.lora.resident]
    assert adapter.lora_int_id in engine._held_adapters()  # parked: never evicted for another
    gate.release()
    outputs = _finish(llm, {"stream", "adapted"})
    assert _tokens(outputs["adapted"]) == base.expected(1, "all")
    (alone,) = llm.generate(
        token_prompts([base.prompts[1]]),
        SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True),
        lora_request=adapter,
    )
    assert _tokens(outputs["adapted"]) == list(alone.outputs[0].token_ids)
    assert len(_tokens(outputs["stream"])) == STREAM_TOKENS
    assert not engine._loading and not engine.runner.lora._reading


def test_concurrent_requests_over_adapters_lose_none(base: Base, llm) -> None:
    """Waves of requests over three adapters and the base (``max_loras=2``: adapters are
    evicted and come back), adapters unloaded between steps whenever no request holds them:
    every request finishes with peft's tokens or a clear refusal, none is lost."""
    engine = llm.engine
    lora = engine.runner.lora
    names: list[str | None] = [None, "all", "qv", "mlp"]
    adapters = {name: base.adapter(name, 200 + i) for i, name in enumerate(names[1:])}
    expected: dict[str, tuple[int, str | None]] = {}
    waves = [[(w, i, names[(w + i) % 4]) for i in range(6)] for w in range(4)]
    refused_at_add: dict[str, Exception] = {}  # an adapter from host memory is placed at once
    step = 0

    def add_wave_and_unload() -> None:
        nonlocal step
        if step < len(waves):
            for w, i, name in waves[step]:
                request_id = f"w{w}-{i}"
                index = (w + i) % len(base.prompts)
                expected[request_id] = (index, name)
                try:
                    _add(llm, request_id, base.prompts[index], adapters.get(name), MAX_NEW)
                except RequestRejectedError as e:
                    refused_at_add[request_id] = e
        held = engine._held_adapters()
        for request in lora.resident:  # the engine-level unload: adapters nobody holds go
            if request.lora_int_id not in held:
                lora.deactivate(request.lora_int_id)
        step += 1

    outputs = {}
    for _ in range(500):
        add_wave_and_unload()
        outputs |= {o.request_id: o for o in llm.client.outputs() if o.finished}
        if step >= len(waves) and not engine.has_unfinished_requests():
            break
    assert set(outputs) | set(refused_at_add) == set(expected)
    assert not set(outputs) & set(refused_at_add)
    for error in refused_at_add.values():  # three adapters held at once, two slots
        assert "max_loras=2" in str(error)
    served = 0
    for request_id, output in outputs.items():
        if isinstance(output, RequestFailure):
            assert "max_loras=2" in str(output.error)
            continue
        assert _tokens(output) == base.expected(*expected[request_id]), request_id
        served += 1
    assert served >= len(expected) // 2
    assert not engine.has_unfinished_requests()


def test_a_failed_read_fails_only_its_request(base: Base, llm, monkeypatch, tmp_path) -> None:
    engine = llm.engine
    write_adapter(base.model, tmp_path / "big", 3, ["q_proj"], r=16, lora_alpha=16)
    gate = Gate(monkeypatch)
    _add(llm, "stream", base.prompts[2], None, MAX_NEW)
    _add(llm, "absent", base.prompts[0], LoRARequest("absent", 301, str(tmp_path / "no")), 4)
    _add(llm, "big", base.prompts[1], LoRARequest("big", 302, str(tmp_path / "big")), 4)
    assert set(engine._loading) == {"absent", "big"}
    gate.release()
    outputs = _finish(llm, {"stream", "absent", "big"})
    assert "adapter_config.json" in str(outputs["absent"].error)
    assert "rank 16" in str(outputs["big"].error) and "max_lora_rank=8" in str(outputs["big"].error)
    assert _tokens(outputs["stream"]) == base.expected(2, None)
    assert not engine._loading and not engine.runner.lora._reading
    # the engine goes on: the offline API raises the same error as before
    with pytest.raises(ValueError, match="adapter_config.json"):
        llm.generate(
            token_prompts([base.prompts[0]]),
            SamplingParams(max_tokens=4, temperature=0),
            lora_request=LoRARequest("absent", 303, str(tmp_path / "no")),
        )


def test_aborting_a_parked_request(base: Base, llm, monkeypatch) -> None:
    engine = llm.engine
    gate = Gate(monkeypatch)
    adapter = base.adapter("mlp", 401)
    _add(llm, "parked", base.prompts[3], adapter, MAX_NEW)
    assert "parked" in engine._loading
    llm.client.abort(["parked"])
    assert not engine._loading and not engine.has_unfinished_requests()
    gate.release()
    # the adapter is read again for the next request, which gets peft's tokens
    _add(llm, "again", base.prompts[3], adapter, MAX_NEW)
    outputs = _finish(llm, {"again"})
    assert _tokens(outputs["again"]) == base.expected(3, "mlp")
