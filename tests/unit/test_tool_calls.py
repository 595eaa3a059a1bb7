"""Tool calls and reasoning read out of generated text (no model): every format whole and
streamed on random splits, markers split across deltas, invalid JSON as content; the grammars
that force a call; the checks on a request's tools."""

from __future__ import annotations

import itertools
import json
import random

import pytest
from llguidance import LLMatcher, LLTokenizer
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from cenote.assistant.grammar import tool_call_grammar
from cenote.assistant.message import AssistantStream, parse_assistant
from cenote.assistant.reasoning import REASONING_FORMATS, reasoning_format
from cenote.assistant.tool_parsers import (
    HERMES,
    JSON_LIST,
    LLAMA3_JSON,
    MISTRAL,
    ToolCallFormat,
    parse_tool_calls,
    tool_call_format,
)
from cenote.assistant.tools import plan_tools
from cenote.engine.chat import render_chat
from cenote.errors import InvalidInputError

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "time", "description": "now"}},
]
HERMES_TWO = (
    "Let me look.\n\n<tool_call>\n"
    '{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
)
LLAMA_TWO = (
    '{"name": "weather", "parameters": {"city": "Paris", "days": 2}}; '
    '{"name": "time", "parameters": {}}'
)
MISTRAL_TWO = (
    'Let me look.[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Paris", "days": 2}}, '
    '{"name": "time", "arguments": {}}]'
)
TWO_CALLS = [("weather", {"city": "Paris", "days": 2}), ("time", {})]


def _calls(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


def _streamed(format, text: str, cuts: list[int], reasoning=None, max_calls=None):
    """(reasoning, content, calls) of ``text`` fed in pieces cut at ``cuts``."""
    stream = AssistantStream(reasoning, format, max_calls=max_calls)
    bounds = [0, *sorted(cuts), len(text)]
    parts = [stream.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [stream.finish()]
    calls = [c for p in parts for c in p.tool_calls]
    assert len({c.id for c in calls}) == len(calls)  # each call streamed once, its own id
    reasoning_text = "".join(p.reasoning for p in parts) or None
    return reasoning_text, "".join(p.content for p in parts) or None, _calls(calls)


def _check_splits(format, text: str, reasoning=None, num_splits: int = 200, max_calls=None) -> None:
    """Every split of ``text`` streams what the whole text parses to (and every 1-char one)."""
    whole = parse_assistant(text, reasoning, format, max_calls=max_calls)
    expected = (whole.reasoning_content, whole.content, _calls(whole.tool_calls))
    rng = random.Random(0)
    for _ in range(num_splits):
        cuts = rng.sample(range(1, len(text)), rng.randint(1, min(12, len(text) - 1)))
        assert _streamed(format, text, cuts, reasoning, max_calls) == expected, cuts
    every = list(range(1, len(text)))
    assert _streamed(format, text, every, reasoning, max_calls) == expected


@pytest.mark.parametrize(
    ("format", "text", "content"),
    [(HERMES, HERMES_TWO, "Let me look."), (LLAMA3_JSON, LLAMA_TWO, None),
     (LLAMA3_JSON, "<|python_tag|>" + LLAMA_TWO, None), (MISTRAL, MISTRAL_TWO, "Let me look."),
     (JSON_LIST, json.dumps([{"name": n, "arguments": a} for n, a in TWO_CALLS]), None)],
)  # fmt: skip
def test_each_format_parses_two_calls_whole_and_streamed(format, text, content):
    parsed_content, calls = parse_tool_calls(format, text)
    assert parsed_content == content
    assert _calls(calls) == TWO_CALLS
    assert all(c.id.startswith("call_") and len(c.id) == 29 and c.type == "function" for c in calls)
    _check_splits(format, text)


@pytest.mark.parametrize(
    ("format", "text"),
    [(HERMES, HERMES_TWO), (LLAMA3_JSON, LLAMA_TWO), (MISTRAL, MISTRAL_TWO),
     (HERMES, HERMES_TWO.replace("<tool_call>", "Then <tool_call>", 2) + " done")],
)  # fmt: skip
def test_one_call_kept_without_parallel_calls(format, text):
    """``max_calls=1`` (parallel_tool_calls false): the first call only, whole and streamed; the
    content around the calls stays."""
    whole = parse_assistant(text, None, format)
    first = parse_assistant(text, None, format, max_calls=1)
    assert _calls(first.tool_calls) == TWO_CALLS[:1]
    assert first.content == whole.content
    _check_splits(format, text, max_calls=1)


@pytest.mark.parametrize(
    ("format", "text"),
    [(HERMES, "Sure <tool_call>\n{not json}\n</tool_call> done"),
     (HERMES, 'x <tool_call>{"name": 3, "arguments": {}}</tool_call>'),
     (HERMES, 'x <tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
     (HERMES, "unclosed <tool_call>\n{\"name\": \"f\", \"argu"),
     (HERMES, 'NaN <tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>'),
     (LLAMA3_JSON, '{"name": "f", "parameters": {}} and then words'),
     (LLAMA3_JSON, "{ this is a brace, not a call"),
     (MISTRAL, "[TOOL_CALLS][{broken"),
     (JSON_LIST, "[1, 2]")],
)  # fmt: skip
def test_invalid_json_in_markers_is_content_verbatim(format, text):
    content, calls = parse_tool_calls(format, text)
    assert calls == [] and content == text
    _check_splits(format, text)


def test_hermes_marker_split_across_deltas_never_leaks():
    stream = AssistantStream(None, HERMES)
    leaked = [stream.feed(piece).content for piece in ("Hi <to", "ol_c", 'all>\n{"na')]
    assert leaked == ["Hi", "", ""]  # the space waits: a call may follow it
    rest = stream.feed('me": "time", "arguments": {}}\n</tool_')
    assert rest.content == "" and rest.tool_calls == []
    done = stream.feed("call>")
    assert _calls(done.tool_calls) == [("time", {})]
    stream.finish()
    # text that only looked like a marker is content again, the held space with it
    other = AssistantStream(None, HERMES)
    assert [other.feed(p).content for p in ("a <tool", "s b")] == ["a", " <tools b"]


def test_unclosed_final_hermes_call_counts_when_its_json_is_whole():
    text = 'ok <tool_call>\n{"name": "time", "arguments": {}}\n'
    content, calls = parse_tool_calls(HERMES, text)
    assert content == "ok" and _calls(calls) == [("time", {})]
    _check_splits(HERMES, text)


def test_content_between_and_after_calls_and_mixed_valid_invalid():
    text = (
        'A\n<tool_call>{"name": "time", "arguments": {}}</tool_call>\nB '
        "<tool_call>oops</tool_call>\n\n"
    )
    content, calls = parse_tool_calls(HERMES, text)
    assert content == "A\nB <tool_call>oops</tool_call>" and _calls(calls) == [("time", {})]
    _check_splits(HERMES, text)
    # plain text keeps its trailing whitespace when no call came
    assert parse_tool_calls(HERMES, "just text\n\n") == ("just text\n\n", [])


def test_random_texts_stream_as_they_parse():
    """Random mixes of text, markers, valid and broken calls, on random splits."""
    pieces = ["hi ", " ", "\n", "<tool_call>", "</tool_call>", '{"name": "time", "arguments": {}}',
              "<tool", "{", "}", "[TOOL_CALLS]", "<think>", "</think>", "[", ";", "x"]  # fmt: skip
    rng = random.Random(1)
    formats: list[ToolCallFormat | None] = [HERMES, LLAMA3_JSON, MISTRAL, JSON_LIST, None]
    for _ in range(150):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 14)))
        format = rng.choice(formats)
        reasoning = rng.choice([None, *REASONING_FORMATS.values()])
        if len(text) > 1:
            _check_splits(format, text, reasoning, num_splits=10)


# ---- reasoning ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("parser", "text", "reasoning", "content"),
    [("qwen3", "<think>\nhmm\n</think>\n\nThe answer", "\nhmm\n", "\n\nThe answer"),
     ("qwen3", "No thinking here", None, "No thinking here"),
     ("qwen3", "<think>cut short", "cut short", None),
     ("deepseek_r1", "opened by the template</think>answer", "opened by the template", "answer"),
     ("deepseek_r1", "<think>a</think>b", "a", "b"),
     ("deepseek_r1", "all thinking", "all thinking", None)],
)  # fmt: skip
def test_reasoning_parsers(parser, text, reasoning, content):
    reply = parse_assistant(text, reasoning_format(parser), None)
    assert (reply.reasoning_content, reply.content) == (reasoning, content)
    _check_splits(None, text, reasoning_format(parser))


def test_thinking_turned_off_reads_no_reasoning():
    """``enable_thinking`` / ``thinking`` false in chat_template_kwargs: the request is read
    without its reasoning format (deepseek_r1 would call a whole answer reasoning)."""
    from cenote.assistant.reasoning import request_reasoning

    r1 = reasoning_format("deepseek_r1")
    assert request_reasoning(r1, None) is r1
    assert request_reasoning(r1, {"enable_thinking": True}) is r1
    assert request_reasoning(r1, {"enable_thinking": False}) is None
    assert request_reasoning(r1, {"thinking": False}) is None
    assert request_reasoning(None, {"enable_thinking": True}) is None


def test_tools_are_parsed_in_the_content_after_reasoning():
    text = (
        '<think>maybe <tool_call>{"name": "weather", "arguments": {}}</tool_call>?</think>'
        'Calling.<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    )
    reply = parse_assistant(text, reasoning_format("qwen3"), HERMES)
    assert reply.reasoning_content.startswith("maybe <tool_call>")
    assert reply.content == "Calling." and _calls(reply.tool_calls) == [("time", {})]
    _check_splits(HERMES, text, reasoning_format("qwen3"))


def test_parser_names():
    with pytest.raises(ValueError, match="auto, none, hermes, llama3_json, mistral"):
        tool_call_format("hermes2", None)
    with pytest.raises(ValueError, match="none, qwen3, deepseek_r1"):
        reasoning_format("qwq")
    assert tool_call_format("auto", "{{ '<tool_call>' }} {{ tools }}") is HERMES
    assert tool_call_format("auto", "[TOOL_CALLS] tools") is MISTRAL
    assert tool_call_format("auto", "<|python_tag|> tools") is LLAMA3_JSON
    assert tool_call_format("auto", "{{ tools }}") is None
    assert tool_call_format("none", "<tool_call> tools") is None


# ---- grammars that force a call -----------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_tokenizer() -> LLTokenizer:
    """One token per byte, and an end-of-sequence token."""
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tokenizer = Tokenizer(models.BPE(vocab={**vocab, "<eos>": len(vocab)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    return LLTokenizer(tokenizer.to_str(), eos_token=len(vocab))


def _accepts(tokenizer: LLTokenizer, lark: str, text: str) -> bool:
    matcher = LLMatcher(tokenizer, LLMatcher.grammar_from_lark(lark))
    ids = tokenizer.tokenize_str(text)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


FUNCTIONS = [("weather", WEATHER), ("time", None)]


@pytest.mark.parametrize(
    ("format", "text"),
    [(HERMES, HERMES_TWO.split("\n\n", 1)[1]), (LLAMA3_JSON, LLAMA_TWO),
     (MISTRAL, MISTRAL_TWO.removeprefix("Let me look.")),
     (JSON_LIST, json.dumps([{"name": n, "arguments": a} for n, a in TWO_CALLS]))],
)  # fmt: skip
def test_required_grammar_accepts_the_format_and_parses_back(byte_tokenizer, format, text):
    parallel = tool_call_grammar(format, FUNCTIONS, parallel=True)
    single = tool_call_grammar(format, FUNCTIONS, parallel=False)
    for lark in (parallel, single):
        assert LLMatcher.validate_grammar(LLMatcher.grammar_from_lark(lark)) == ""
    assert _accepts(byte_tokenizer, parallel, text)
    assert not _accepts(byte_tokenizer, single, text)  # two calls: parallel only
    assert _calls(parse_tool_calls(format, text)[1]) == TWO_CALLS


def test_named_grammar_takes_that_function_and_its_schema_only(byte_tokenizer):
    lark = tool_call_grammar(HERMES, [("weather", WEATHER)], parallel=False)
    good = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    assert _accepts(byte_tokenizer, lark, good)
    assert not _accepts(byte_tokenizer, lark, good.replace('"Oslo"', "3"))  # not a string
    assert not _accepts(byte_tokenizer, lark, good.replace("weather", "time"))
    assert not _accepts(byte_tokenizer, lark, good.replace('"city": "Oslo"', ""))  # required
    special = tool_call_grammar(MISTRAL, [("time", None)], False, {"[TOOL_CALLS]": 5})
    assert special.startswith("start: <[5]> ")


# ---- a request's tools ---------------------------------------------------------------------------

TEMPLATE = (
    "{% if tools %}{% for t in tools %}{{ t | tojson }}\n{% endfor %}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "\n{% endfor %}"
)


def _plan(tools=TOOLS, choice=None, template=TEMPLATE, format=HERMES, parallel=None):
    return plan_tools(tools, choice, parallel, template, format)


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [(dict(choice={"type": "function", "function": {"name": "nope"}}), "tool_choice",
      "'nope', which is not in tools (the tools are weather, time)"),
     (dict(tools=None, choice="required"), "tool_choice", "needs tools"),
     (dict(tools=[], choice={"type": "function", "function": {"name": "f"}}), "tool_choice",
      "needs tools"),
     (dict(tools=[TOOLS[0], TOOLS[0]]), "tools", "'weather' 2 times"),
     (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]), "tools",
      "tools[0].function.parameters must be a JSON schema object, got list"),
     (dict(template="{{ messages }}"), "tools", "never reads 'tools'"),
     (dict(tools=[{"type": "retrieval"}]), "tools", "function tools are the only kind"),
     (dict(tools=[{"type": "function", "function": {"name": "f",
                                                    "parameters": {"type": 3}}}],
           choice="required"), "tools", "do not compile")],
)  # fmt: skip
def test_bad_tools_name_the_field(kwargs, param, words):
    with pytest.raises(InvalidInputError) as error:
        _plan(**kwargs)
    assert error.value.param == param and words in str(error.value)


def test_plans():
    assert _plan(tools=None) is None
    auto = _plan()
    assert auto.tool_choice == "auto" and auto.format is HERMES and auto.grammar is None
    assert _plan(choice="none").format is None  # rendered, not parsed (vLLM)
    required = _plan(choice="required", format=None)  # no known format: cenote's JSON list
    assert required.format is JSON_LIST and "%json" in required.grammar
    named = _plan(choice={"type": "function", "function": {"name": "time"}})
    assert named.function_name == "time" and '"weather"' not in named.grammar
    assert auto.template_tools()[1] == {
        "type": "function", "function": {"name": "time", "description": "now"}
    }  # fmt: skip


def test_template_renders_tools_and_tool_call_round_trips():
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    text = render_chat(TEMPLATE, messages, tools=_plan().template_tools())
    assert text.splitlines()[0] == json.dumps(TOOLS[0])
    # arguments reach the template as a dict: tojson writes them once, not as a quoted string
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Paris"}}</tool_call>' in text
    assert "tool: sunny" in text
    bad = [messages[0], {**messages[1], "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]  # fmt: skip
    with pytest.raises(InvalidInputError, match="message 1: tool_calls\\[0\\].function.arguments"):
        render_chat(TEMPLATE, bad)


def test_tool_conversations_render_as_transformers_renders_them():
    """Tools, an assistant turn with tool_calls (arguments as OpenAI's JSON string) and the
    tool's result render exactly as transformers' ``apply_chat_template(tools=...)`` renders
    the same conversation (arguments as the object HF templates read)."""
    from transformers import PreTrainedTokenizerFast

    template = (
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{% endif %}"
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function.name }} "
        "{{ c.function.arguments | tojson }}</tool_call>{% endfor %}"
        "{% if m.tool_call_id %} ({{ m.tool_call_id }}){% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    arguments = {"city": "Zürich", "days": 2, "tags": ["a", "b"]}
    call = {"id": "call_1", "type": "function", "function": {"name": "weather"}}
    messages = [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{**call, "function": {**call["function"],
                                              "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21°C"},
    ]  # fmt: skip
    tools = _plan().template_tools()
    ours = render_chat(template, messages, tools=tools)
    hf_messages = [dict(m) for m in messages]
    hf_messages[2] = {**messages[2], "content": "", "tool_calls": [
        {**call, "function": {**call["function"], "arguments": arguments}}]}  # fmt: skip
    hf = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    )
    hf.chat_template = template
    theirs = hf.apply_chat_template(
        hf_messages, tools=tools, tokenize=False, add_generation_prompt=True
    )
    assert ours == theirs


def test_a_constraint_starts_after_a_one_token_end_of_thinking():
    """With a reasoning format, the output constraint starts after ``</think>`` where the
    vocabulary has it as one token (Qwen3, DeepSeek-R1); not with thinking turned off, nor
    where the marker is only bytes (its tokens could never be told apart from text)."""
    from tokenizers import Tokenizer, models

    from cenote import SamplingParams, StructuredOutputsParams
    from cenote.assistant.reasoning import REASONING_FORMATS, constrain_after_thinking

    tokenizer = Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))
    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
    qwen3 = REASONING_FORMATS["qwen3"]
    assert constrain_after_thinking(params, qwen3, tokenizer, None) is params  # one <unk>
    tokenizer.add_special_tokens(["</think>"])
    end_id = tokenizer.token_to_id("</think>")
    after = constrain_after_thinking(params, qwen3, tokenizer, None)
    assert after.structured_outputs is not None
    assert after.structured_outputs.start_after_token_ids == [end_id]
    off = constrain_after_thinking(params, qwen3, tokenizer, {"enable_thinking": False})
    assert off is params
    assert constrain_after_thinking(params, None, tokenizer, None) is params
