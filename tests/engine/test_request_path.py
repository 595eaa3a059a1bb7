"""The one request path: ``InputProcessor.process`` (tokenization as the params say, chat and
pair prompts, n > 1 fan-out, max_tokens from the context), the in-process engine client, and
the output kinds (FINAL_ONLY builds nothing before the end; DELTA pieces add up to the
CUMULATIVE result and never show text a stop string later removes), and the status each of
cenote's errors maps to."""

from __future__ import annotations

import dataclasses

import pytest
from factories.decoders import make_decoder
from factories.generation import make_llm, random_prompts, token_prompts

from cenote import PoolingParams, SamplingParams
from cenote.engine.input_processor import InputProcessor
from cenote.errors import (
    CenoteError,
    EngineDeadError,
    InvalidInputError,
    InvalidInputTypeError,
    RequestFailedError,
    RequestRejectedError,
    UnsupportedTaskError,
)
from cenote.sampling_params import RequestOutputKind

MAX_MODEL_LEN = 64
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    folder = tmp_path_factory.mktemp("llama")
    make_decoder(folder, "llama")
    return make_llm(folder, block_size=4, max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def uncached_llm(tmp_path_factory: pytest.TempPathFactory):
    """The same model without prefix caching: a second run of a prompt computes it whole, as the
    first did. With caching it starts after the first run's cached blocks, and a 2-token prefill
    after 4 cached tokens rounds differently from a 6-token one (ulp-level: 5e-7 on an AMD Zen 5
    fp32 run, well inside the batch-invariance tolerance), which a test comparing the logprobs
    of two runs exactly must not see."""
    folder = tmp_path_factory.mktemp("llama_uncached")
    make_decoder(folder, "llama")
    return make_llm(folder, block_size=4, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)


def _run(llm, params: SamplingParams, prompt: list[int]) -> list:
    """Every output of one request, as the client hands them out step by step."""
    request = llm.input_processor.process("r", {"prompt_token_ids": prompt}, params)
    llm.client.add([request])
    outputs = []
    while llm.client.num_unfinished:
        outputs += [out for out in llm.client.outputs() if out.request_id == "r"]
    return outputs


# ---- process() ----------------------------------------------------------------------------------


def test_n_completions_fan_out_with_one_id_scheme(llm) -> None:
    params = SamplingParams(n=3, seed=7, max_tokens=4)
    request = llm.input_processor.process("req", "w5 w6", params)
    assert [c.request_id for c in request.children] == ["req-0", "req-1", "req-2"]
    assert [c.sampling_params.seed for c in request.children] == [7, 8, 9]
    assert all(c.sampling_params.n == 1 for c in request.children)
    single = llm.input_processor.process("one", "w5 w6", SamplingParams(max_tokens=4))
    assert [c.request_id for c in single.children] == ["one"]


def test_truncation_comes_from_the_params(llm) -> None:
    prompt = {"prompt_token_ids": list(range(10, 40))}
    process = llm.input_processor.process
    left = process("a", prompt, SamplingParams(truncate_prompt_tokens=8, max_tokens=2))
    assert left.prompt_token_ids == list(range(32, 40))  # generation keeps the prompt's end
    right = SamplingParams(truncate_prompt_tokens=8, truncation_side="right", max_tokens=2)
    assert process("b", prompt, right).prompt_token_ids == list(range(10, 18))
    embed = PoolingParams(task="embed", truncate_prompt_tokens=8)
    assert process("c", prompt, embed).prompt_token_ids == list(range(10, 18))


def test_max_tokens_none_is_what_the_context_has_left(llm) -> None:
    prompt = {"prompt_token_ids": random_prompts([10], seed=1)[0]}
    request = llm.input_processor.process("a", prompt, SamplingParams(max_tokens=None))
    assert request.children[0].sampling_params.max_tokens == MAX_MODEL_LEN - 10
    capped = llm.input_processor.process(
        "b", prompt, SamplingParams(max_tokens=None), default_max_tokens=16
    )
    assert capped.children[0].sampling_params.max_tokens == 16
    with pytest.raises(InvalidInputError, match=r"prompt 0 has 10 tokens.*max_tokens=60.*64"):
        llm.input_processor.process("c", prompt, SamplingParams(max_tokens=60))


def test_chat_prompts_are_rendered_without_special_tokens(llm) -> None:
    chat = {"messages": [{"role": "user", "content": "w5 w6"}], "chat_template": TEMPLATE}
    request = llm.input_processor.process("a", chat, SamplingParams(max_tokens=2))
    text = llm.input_processor.process("b", "w5 w6 ", SamplingParams(max_tokens=2))
    assert request.prompt == "w5 w6 "
    assert request.prompt_token_ids == llm.tokenizer.encode("w5 w6 ", add_special_tokens=False).ids
    assert text.prompt_token_ids == llm.tokenizer.encode("w5 w6 ").ids
    (out,) = llm.chat(chat["messages"], SamplingParams(max_tokens=2), chat_template=TEMPLATE)
    assert out.prompt_token_ids == request.prompt_token_ids


def test_pair_prompts_carry_segment_ids(llm_fp32) -> None:
    pair = {"text": "a cat", "text_pair": "sat on the mat"}
    request = llm_fp32.input_processor.process("p", pair, PoolingParams(task="embed"))
    expected = llm_fp32.tokenizer.encode("a cat", "sat on the mat")
    assert request.prompt_token_ids == expected.ids
    assert request.children[0].token_type_ids == expected.type_ids
    assert request.prompt is None


@pytest.mark.parametrize(
    ("prompt", "params", "error", "message"),
    [
        (5, SamplingParams(), InvalidInputTypeError, "prompt 0 is a int; expected a string"),
        ({"text": "a"}, SamplingParams(), InvalidInputTypeError, "'text' and 'text_pair'"),
        ("w5", PoolingParams(), InvalidInputError, "pooling params need a task"),
        ("w5", "greedy", InvalidInputTypeError, "params must be SamplingParams or PoolingParams"),
        ("w5", PoolingParams(task="classify"), UnsupportedTaskError, "task 'classify' is not"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "chat_template": TEMPLATE,
             "chat_template_kwargs": {"add_generation_prompt": False}},
            SamplingParams(), InvalidInputError,
            "chat_template_kwargs may not set add_generation_prompt",
        ),
        (
            {"messages": [{"role": "user", "content": 5}], "chat_template": TEMPLATE},
            SamplingParams(), InvalidInputError,
            "message 0: content must be a string or a list of content parts, got int",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}],
             "chat_template": TEMPLATE},
            SamplingParams(), InvalidInputError,
            "message 0: content part 0 has type 'image_url'; this model reads text parts only",
        ),
    ],
)  # fmt: skip
def test_bad_input_is_refused_with_cenotes_own_errors(llm, prompt, params, error, message):
    with pytest.raises(error, match=message):
        llm.input_processor.process("bad", prompt, params)


def test_max_input_chars_holds_every_text_chats_once_rendered(llm) -> None:
    """The server's --max-input-chars: plain texts, and chat prompts as the template renders
    them (here one character longer than the message), are refused before tokenization."""
    ip = llm.input_processor
    processor = InputProcessor(ip.model_config, ip.tokenizer, ip.capabilities, max_input_chars=5)
    params = SamplingParams(max_tokens=1)
    assert processor.process("ok", "w5 w6", params).prompt == "w5 w6"
    with pytest.raises(
        InvalidInputError, match="prompt 0 has 6 characters, more than the limit of 5"
    ):
        processor.process("long", "w5 w60", params)
    chat = {"messages": [{"role": "user", "content": "w5 w6"}], "chat_template": TEMPLATE}
    with pytest.raises(InvalidInputError, match=r"prompt 0 \(rendered\) has 6 characters"):
        processor.process("chat", chat, params)
    pair = {"text": "w5", "text_pair": "w6 w7 w8"}
    with pytest.raises(InvalidInputError, match="prompt 0's text_pair has 8 characters"):
        processor.process("pair", pair, PoolingParams(task="embed"))


# ---- output kinds -------------------------------------------------------------------------------


def test_final_only_builds_one_output(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)
    prompt = random_prompts([5], seed=2)[0]
    final = _run(llm, _with_kind(params, RequestOutputKind.FINAL_ONLY), prompt)
    cumulative = _run(llm, _with_kind(params, RequestOutputKind.CUMULATIVE), prompt)
    assert len(final) == 1 and final[0].finished
    assert len(cumulative) == 6  # one per generated token
    assert final[0].outputs[0].token_ids == cumulative[-1].outputs[0].token_ids
    assert final[0].outputs[0].text == cumulative[-1].outputs[0].text
    assert final[0].num_generated_tokens == 6


# "1 w": a text ending in "1" is held back until the next word shows whether the stop string
# follows (then the "1" is cut and never sent)
@pytest.mark.parametrize("stop", [None, "1 w"])
def test_delta_pieces_add_up_to_the_cumulative_result(uncached_llm, stop) -> None:
    llm = uncached_llm
    params = SamplingParams(
        n=4, seed=3, temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=2, stop=stop
    )
    prompt = random_prompts([6], seed=4)[0]
    deltas = _run(llm, _with_kind(params, RequestOutputKind.DELTA), prompt)
    (final,) = _run(llm, _with_kind(params, RequestOutputKind.FINAL_ONLY), prompt)
    for completion in final.outputs:
        pieces = [c for out in deltas for c in out.outputs if c.index == completion.index]
        assert "".join(c.text for c in pieces) == completion.text
        assert [t for c in pieces for t in c.token_ids] == completion.token_ids
        assert [e for c in pieces for e in c.logprobs] == completion.logprobs
        assert [c.finish_reason for c in pieces][-1] == completion.finish_reason
        assert all(c.finish_reason is None for c in pieces[:-1])
    assert deltas[-1].finished and deltas[-1].num_generated_tokens == final.num_generated_tokens


def test_offline_calls_read_only_final_outputs(llm, monkeypatch) -> None:
    """LLM.generate asks for FINAL_ONLY: no output is built for a running request."""
    built = []
    processor = llm.client.output_processor
    original = processor._request_output
    monkeypatch.setattr(
        processor, "_request_output", lambda state: built.append(original(state)) or built[-1]
    )
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    outputs = llm.generate(token_prompts(random_prompts([4, 6], seed=5)), params, use_tqdm=False)
    assert [o.finished for o in outputs] == [True, True]
    assert [o for o in built if o is not None] == outputs


def _with_kind(params: SamplingParams, kind: RequestOutputKind) -> SamplingParams:
    return dataclasses.replace(params, output_kind=kind)


# ---- errors keep their cause --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "type_", "param"),
    [
        (InvalidInputError("too long", param="input"), 400, "invalid_request_error", "input"),
        (UnsupportedTaskError("task 'x' is not supported"), 400, "invalid_request_error", None),
        (RequestRejectedError("cannot fit one step"), 400, "invalid_request_error", None),
        (EngineDeadError("the core died"), 503, "service_unavailable", None),
        (RequestFailedError("request r failed in the engine: boom", "r"), 500,
         "internal_server_error", None),
        (ValueError("a bug"), 500, "internal_server_error", None),  # not the client's fault
        (TypeError("a bug"), 500, "internal_server_error", None),
    ],
)  # fmt: skip
def test_each_error_type_has_its_status(error, status, type_, param, caplog) -> None:
    from cenote.server.errors import describe_error

    got_status, message, got_type, got_param = describe_error(error)
    assert (got_status, got_type, got_param) == (status, type_, param)
    if isinstance(error, CenoteError):
        assert str(error) in message
    else:  # a bug: the answer names an id, the log has the traceback under it
        assert message.startswith(f"internal error: {type(error).__name__} (error id ")
        error_id = message.split("error id ")[1].split(",")[0]
        (record,) = [r for r in caplog.records if error_id in r.getMessage()]
        assert record.exc_info is not None and record.exc_info[1] is error


def test_waiting_on_a_request_that_is_not_running_raises(llm) -> None:
    """An id that finished (or was never added) is refused at once: stepping an idle engine
    for it would never end (a test that waited on a finished id once grew to 20 GB)."""
    llm.generate(token_prompts(random_prompts([3])), SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="not running"):
        llm.client.wait(["0"])
    out = llm.generate(token_prompts(random_prompts([3])), SamplingParams(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2  # the engine serves on
