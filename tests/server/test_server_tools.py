"""Tool calling and reasoning through a real server on a tiny random decoder over a byte-level
tokenizer, with a Hermes-style chat template (so the tool call format is found: hermes) and
``--reasoning-parser qwen3``: tools rendered into the prompt, garbage output as plain content,
forced calls (tool_choice required / named) whose arguments validate against the tool's
schema, streamed and not, the 400s naming their field; and offline ``LLM.chat(tools=...)``."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from factories.decoders import make_byte_level_decoder
from factories.generation import make_llm

from cenote import SamplingParams, StructuredOutputsParams
from tests.server_fixture import ServerProcess

TIMEOUT = 120
TEMPLATE = (
    "{% if tools %}# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}"
    'Call a tool as <tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>\n{% endif %}'
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for call in m.tool_calls or [] %}<tool_call>\n{{ call.function | tojson }}\n</tool_call>"
    "{% endfor %}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
# closed objects: a random model adds properties to an open one until max_tokens
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
         "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "clock", "parameters": CLOCK}},
]  # fmt: skip
SCHEMAS = {"weather": WEATHER, "clock": CLOCK}
USER = [{"role": "user", "content": "weather in Oslo?"}]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("byte-tools")
    make_byte_level_decoder(folder, "qwen2", seed=3)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


@pytest.fixture(scope="module")
def server(model_folder):
    server = ServerProcess(
        str(model_folder), "--dtype", "float32", "--num-threads", "1", "--max-num-seqs", "4",
        "--reasoning-parser", "qwen3",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def _chat(server, **fields) -> httpx.Response:
    body = {"messages": USER, "temperature": 0, "max_tokens": 40, **fields}
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=TIMEOUT)


def _stream(server, **fields) -> list[dict]:
    response = _chat(server, stream=True, **fields)
    assert response.status_code == 200, response.text
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def _joined(chunks: list[dict]) -> dict:
    """The streamed choice 0 put together: content, reasoning, tool calls, finish reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        for choice in chunk["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning_content") or ""
            for call in delta.get("tool_calls") or []:
                if "id" in call:  # the first delta of a call names it
                    assert call["index"] not in calls and call["type"] == "function"
                    calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"],
                                            "arguments": ""}  # fmt: skip
                calls[call["index"]]["arguments"] += call["function"]["arguments"]
            finish = choice.get("finish_reason") or finish
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [calls[i] for i in sorted(calls)], "finish": finish}  # fmt: skip


def _whole(response: httpx.Response) -> dict:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    message = choice["message"]
    calls = [{"id": c["id"], "name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls") or []]  # fmt: skip
    return {"content": message["content"], "reasoning": message.get("reasoning_content"),
            "calls": calls, "finish": choice["finish_reason"]}  # fmt: skip


def _without_ids(reply: dict) -> dict:
    return {**reply, "calls": [{k: v for k, v in c.items() if k != "id"} for c in reply["calls"]]}


def test_tools_and_tool_calls_are_rendered_into_the_prompt(server):
    history = [*USER,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]  # fmt: skip
    response = _chat(server, messages=history, tools=TOOLS, max_tokens=1, return_token_ids=True)
    assert response.status_code == 200, response.text
    ids = response.json()["prompt_token_ids"]
    prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
    assert json.dumps(TOOLS[0]) in prompt and json.dumps(TOOLS[1]) in prompt
    # the JSON-string arguments reach the template as an object
    assert '{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}' in prompt
    assert "<tool>sunny" in prompt
    plain = _chat(server, messages=history, max_tokens=1, return_token_ids=True).json()
    assert (
        "# Tools"
        not in httpx.post(
            f"{server.url}/detokenize", json={"tokens": plain["prompt_token_ids"]}
        ).json()["prompt"]
    )


def test_auto_with_garbage_output_is_plain_content(server):
    """Random weights write random bytes: no call, all content, streamed as whole."""
    whole = _whole(_chat(server, tools=TOOLS))
    assert whole["calls"] == [] and whole["finish"] in ("stop", "length")
    assert whole["reasoning"] is None  # no <think>: qwen3 leaves it all content
    plain = _whole(_chat(server, tools=TOOLS, tool_choice="none"))
    assert plain["calls"] == []
    assert _joined(_stream(server, tools=TOOLS)) == whole


# a regex makes the random model write calls in the template's (hermes) format, as a model
# that chose to call would: tool_choice auto must find them, none must leave them as text
CLOCK_CALL = '<tool_call>\n{"name": "clock", "arguments": {"zone": "%s"}}\n</tool_call>'
TWO_CALLS = "Checking.\n" + CLOCK_CALL % "utc" + "\n" + CLOCK_CALL % "cet"


def test_auto_reads_the_calls_the_model_wrote(server):
    """tool_choice auto: the calls in the output (whatever made the model write them) become
    tool_calls, finish_reason tool_calls, streamed as whole; parallel_tool_calls false keeps the
    first (vLLM, OpenAI); tool_choice none and requests without tools leave the text as it is."""
    fields = dict(tools=TOOLS, guided_regex=re.escape(TWO_CALLS), max_tokens=200)
    whole = _whole(_chat(server, **fields))
    arguments = ['{"zone": "utc"}', '{"zone": "cet"}']
    assert whole["content"] == "Checking." and whole["finish"] == "tool_calls", whole
    assert [(c["name"], c["arguments"]) for c in whole["calls"]] == [
        ("clock", a) for a in arguments
    ]
    assert _without_ids(_joined(_stream(server, **fields))) == _without_ids(whole)
    one = dict(fields, parallel_tool_calls=False)
    first = _whole(_chat(server, **one))
    assert [c["arguments"] for c in first["calls"]] == arguments[:1]
    assert first["content"] == "Checking." and first["finish"] == "tool_calls"
    assert _without_ids(_joined(_stream(server, **one))) == _without_ids(first)
    for plain in (dict(fields, tool_choice="none"), dict(fields, tools=None)):
        text = _whole(_chat(server, **plain))
        assert text == {"content": TWO_CALLS, "reasoning": None, "calls": [], "finish": "stop"}
        assert _joined(_stream(server, **plain)) == text


def test_reasoning_streams_as_deltas(server):
    """--reasoning-parser qwen3: the thinking the model wrote is reasoning_content, streamed
    over several deltas that add up to the whole answer's; with chat_template_kwargs
    enable_thinking false the output is all content, as written."""
    fields = dict(guided_regex=r"<think>[a-z]{12}</think>[a-z]{6}", max_tokens=60)
    whole = _whole(_chat(server, **fields))
    assert re.fullmatch("[a-z]{12}", whole["reasoning"]) and re.fullmatch(
        "[a-z]{6}", whole["content"]
    )
    chunks = _stream(server, **fields)
    parts = [c["choices"][0]["delta"].get("reasoning_content") for c in chunks if c["choices"]]
    assert len([p for p in parts if p]) > 1, parts  # deltas, not one block at the end
    assert _joined(chunks) == whole
    off = dict(fields, chat_template_kwargs={"enable_thinking": False})
    text = _whole(_chat(server, **off))
    assert text["reasoning"] is None
    assert text["content"] == f"<think>{whole['reasoning']}</think>{whole['content']}"
    assert _joined(_stream(server, **off)) == text


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "clock"}}]
)
@pytest.mark.parametrize("seed", [None, 11])
def test_forced_calls_validate_against_their_schema(server, tool_choice, seed):
    """The grammar makes the random model call a tool, in the template's hermes format."""
    fields = dict(tools=TOOLS, tool_choice=tool_choice, max_tokens=200)
    if seed is not None:
        fields.update(temperature=1.0, seed=seed)
    whole = _whole(_chat(server, **fields))
    assert whole["finish"] == "tool_calls" and whole["calls"], whole
    for call in whole["calls"]:
        assert call["id"].startswith("call_")
        if isinstance(tool_choice, dict):
            assert call["name"] == "clock"
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    streamed = _joined(_stream(server, **fields))
    assert _without_ids(streamed) == _without_ids(whole)
    assert len({c["id"] for c in streamed["calls"]}) == len(streamed["calls"])


def test_n_choices_stream_their_own_calls(server):
    """n=2 sampled forced calls: each streamed choice (its deltas by index) adds up to the
    same choice of the whole answer."""
    fields = dict(tools=TOOLS, tool_choice="required", n=2, temperature=1.0, seed=5,
                  max_tokens=120)  # fmt: skip
    response = _chat(server, **fields)
    assert response.status_code == 200, response.text
    whole = response.json()["choices"]
    chunks = _stream(server, **fields)
    for index in (0, 1):
        mine = [{"choices": [c for c in chunk["choices"] if c["index"] == index]}
                for chunk in chunks]  # fmt: skip
        message = whole[index]["message"]
        expected = {"content": message["content"], "reasoning": message["reasoning_content"],
                    "calls": [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                              for c in message.get("tool_calls") or []],
                    "finish": whole[index]["finish_reason"]}  # fmt: skip
        assert expected["calls"], message
        assert _without_ids(_joined(mine)) == expected


def test_parallel_tool_calls_false_gives_one_call(server):
    for seed in (1, 2, 3):
        whole = _whole(
            _chat(server, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                  max_tokens=200, temperature=1.0, seed=seed)
        )  # fmt: skip
        assert len(whole["calls"]) == 1, whole


def test_openai_client(server):
    from openai import OpenAI

    client = OpenAI(base_url=f"{server.url}/v1", api_key="none", timeout=TIMEOUT)
    model = client.models.list().data[0].id
    completion = client.chat.completions.create(
        model=model, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=0,
    )  # fmt: skip
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    stream = client.chat.completions.create(
        model=model, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=200,
        temperature=0, stream=True,
    )  # fmt: skip
    names = [c.function.name for chunk in stream for d in [chunk.choices[0].delta]
             for c in d.tool_calls or [] if c.function and c.function.name]  # fmt: skip
    assert names == [c.function.name for c in choice.message.tool_calls]
    auto = client.chat.completions.create(model=model, messages=USER, tools=TOOLS, max_tokens=8)
    assert auto.choices[0].message.tool_calls is None


def test_langchain_bind_tools(server):
    """LangChain's ``ChatOpenAI(...).bind_tools(tools, tool_choice=...)``, unmodified: the forced
    call comes back as an ``AIMessage.tool_calls`` entry with arguments valid for its schema."""
    from langchain_openai import ChatOpenAI

    model = httpx.get(f"{server.url}/v1/models", timeout=TIMEOUT).json()["data"][0]["id"]
    chat = ChatOpenAI(
        base_url=f"{server.url}/v1", api_key="none", model=model, temperature=0,
        max_tokens=200, timeout=TIMEOUT,
    )  # fmt: skip
    message = chat.bind_tools(TOOLS, tool_choice="weather").invoke(USER[0]["content"])
    assert [call["name"] for call in message.tool_calls] == ["weather"]
    jsonschema.validate(message.tool_calls[0]["args"], WEATHER)


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [(dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}),
      "tool_choice", "not in tools"),
     (dict(tool_choice="required"), "tool_choice", "needs tools"),
     (dict(tools=[TOOLS[0], TOOLS[0]]), "tools", "unique"),
     (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": [1]}}]),
      "tools", "tools.0.function.parameters: Input should be a valid dictionary"),
     (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice", ""),
     (dict(tools=TOOLS, functions=[{"name": "f"}]), "functions", "not both"),
     (dict(functions=[{"name": "f"}, {"name": "f"}]), "functions", "unique"),
     (dict(functions=[{"name": "f"}], function_call={"name": "g"}), "function_call",
      "not in tools"),
     (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
      "tool_choice", "cannot be combined"),
     (dict(messages=[{"role": "assistant", "tool_calls": [
         {"type": "function", "function": {"name": "f", "arguments": "{bad"}}]}]),
      None, "not valid JSON")],
)  # fmt: skip
def test_bad_tool_requests_are_400_naming_the_field(server, fields, param, words):
    response = _chat(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"]
    if param is not None:
        assert param in (error["param"] or ""), error


def test_legacy_functions_map_to_tools(server):
    functions = [t["function"] for t in TOOLS]
    whole = _whole(
        _chat(server, functions=functions, function_call={"name": "weather"}, max_tokens=200)
    )
    assert [c["name"] for c in whole["calls"]] == ["weather"]


def test_template_without_tools_is_400(smollm2_server):
    body = {"messages": USER, "tools": TOOLS, "max_tokens": 1}
    response = httpx.post(f"{smollm2_server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    assert "never reads 'tools'" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] == "tools"


# ---- offline ---------------------------------------------------------------------------------


def test_llm_chat_with_tools(model_folder):
    llm = make_llm(model_folder)
    params = SamplingParams(temperature=0, max_tokens=200)
    forced = llm.chat(USER, params, tools=TOOLS, tool_choice="required")[0].outputs[0]
    assert forced.tool_calls, forced.text
    for call in forced.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    auto = llm.chat(USER, SamplingParams(temperature=0, max_tokens=8), tools=TOOLS)[0].outputs[0]
    assert auto.tool_calls == []  # parsed, none found
    plain = llm.chat(USER, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert plain.tool_calls is None and plain.reasoning_content is None
    thinking = llm.chat(
        USER, SamplingParams(temperature=0, max_tokens=8), reasoning_parser="deepseek_r1",
        chat_template_kwargs={"enable_thinking": True},
    )[0].outputs[0]  # fmt: skip
    assert thinking.reasoning_content == plain.text  # no </think>: all thinking
    off = llm.chat(
        USER, SamplingParams(temperature=0, max_tokens=8), reasoning_parser="deepseek_r1",
        chat_template_kwargs={"enable_thinking": False},
    )[0].outputs[0]  # fmt: skip
    assert off.reasoning_content is None and off.text == plain.text  # thinking off: the answer
    calls = SamplingParams(
        temperature=0, max_tokens=200,
        structured_outputs=StructuredOutputsParams(regex=re.escape(TWO_CALLS)),
    )  # fmt: skip
    both = llm.chat(USER, calls, tools=TOOLS)[0].outputs[0]
    assert [c.function.arguments for c in both.tool_calls] == ['{"zone": "utc"}', '{"zone": "cet"}']
    one = llm.chat(USER, calls, tools=TOOLS, parallel_tool_calls=False)[0].outputs[0]
    assert [c.function.arguments for c in one.tool_calls] == ['{"zone": "utc"}']


def test_smollm2_gguf_forced_calls_with_a_tool_template():
    """The real GGUF (byte-level BPE from the file) under a chat template that renders tools:
    required and named tool_choice give one call whose arguments validate, greedy and sampled
    (with parallel calls allowed, the 135M model repeats its call until max_tokens); auto
    parses whatever it wrote without failing."""
    from factories.generation import smollm2_path

    from cenote import LLM

    llm = LLM(str(smollm2_path()), num_threads=2)
    question = [{"role": "user", "content": "What is the weather in Oslo for 3 days?"}]
    for seed in (None, 4):
        params = SamplingParams(temperature=0 if seed is None else 1.0, seed=seed, max_tokens=120)
        for choice in ("required", {"type": "function", "function": {"name": "weather"}}):
            reply = llm.chat(question, params, chat_template=TEMPLATE, tools=TOOLS,
                             tool_choice=choice, parallel_tool_calls=False,
                             use_tqdm=False)[0].outputs[0]  # fmt: skip
            assert reply.finish_reason == "stop" and len(reply.tool_calls) == 1, reply.text
            for call in reply.tool_calls:
                assert isinstance(choice, str) or call.function.name == "weather"
                jsonschema.validate(
                    json.loads(call.function.arguments), SCHEMAS[call.function.name]
                )
    auto = llm.chat(question, SamplingParams(temperature=0, max_tokens=40),
                    chat_template=TEMPLATE, tools=TOOLS, use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert auto.tool_calls is not None
