"""Structured outputs over HTTP on the shared SmolLM2 server: OpenAI's ``response_format``
(the official client's ``chat.completions.parse`` with a pydantic model, unmodified), vLLM's
``structured_outputs`` and its older ``guided_*`` fields on both generation routes, streamed and
not; every output checked by ``jsonschema`` / ``re``; bad constraints answer 400 naming the
field, and the server serves on."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

TIMEOUT = 120


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=20)


def _post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{route}", json=body, timeout=TIMEOUT)


def _chat(content: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": content}], "temperature": 0, **fields}


def test_openai_parse_with_a_pydantic_model(smollm2_server):
    """``client.chat.completions.parse(response_format=Person)`` sends a strict json_schema;
    the answer parses into the model."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{smollm2_server.url}/v1", api_key="none", timeout=TIMEOUT)
    completion = client.chat.completions.parse(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Invent a person: name, age and city."}],
        response_format=Person,
        max_tokens=120,
        temperature=0,
    )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Person), message.content
    jsonschema.validate(json.loads(message.content or ""), Person.model_json_schema())


def test_langchain_with_structured_output(smollm2_server):
    """LangChain's ``ChatOpenAI(...).with_structured_output(PydanticModel)``, unmodified."""
    from langchain_openai import ChatOpenAI

    model = httpx.get(f"{smollm2_server.url}/v1/models", timeout=TIMEOUT).json()["data"][0]
    chat = ChatOpenAI(
        base_url=f"{smollm2_server.url}/v1", api_key="none", model=model["id"],
        temperature=0, max_tokens=120, timeout=TIMEOUT,
    )  # fmt: skip
    person = chat.with_structured_output(Person).invoke("Invent a person: name, age and city.")
    assert isinstance(person, Person)


def test_json_schema_streamed_and_not(smollm2_server):
    schema = {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                  "minItems": 1, "maxItems": 3}},
        "required": ["colors"],
    }  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}
    body = _chat("Name some colors as JSON.", max_tokens=80, response_format=response_format)
    whole = _post(smollm2_server, "/v1/chat/completions", body).json()
    text = whole["choices"][0]["message"]["content"]
    jsonschema.validate(json.loads(text), schema)
    streamed = _post(smollm2_server, "/v1/chat/completions", {**body, "stream": True})
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    deltas = [c["delta"].get("content") or "" for chunk in chunks for c in chunk["choices"]]
    assert "".join(deltas) == text


@pytest.mark.parametrize(
    ("fields", "check"),
    [
        ({"structured_outputs": {"choice": ["positive", "negative"]}}, "positive|negative"),
        ({"guided_choice": ["positive", "negative"]}, "positive|negative"),
        ({"structured_outputs": {"regex": "[0-9]{2}:[0-9]{2}"}}, "[0-9]{2}:[0-9]{2}"),
        ({"guided_regex": "(yes|no), [a-z]{1,8}"}, "(yes|no), [a-z]{1,8}"),
        ({"guided_grammar": 'root ::= "A" | "B" | "C"'}, "A|B|C"),
        ({"guided_json": {"enum": ["yes", "no"]}}, '"(yes|no)"'),
        (
            {"structured_outputs": {"json": {"type": "integer", "minimum": 10, "maximum": 99}}},
            "[1-9][0-9]",
        ),
        ({"structured_outputs": {"grammar": 'start: "x" /[0-9]{3}/'}}, "x[0-9]{3}"),
    ],
)
def test_completions_and_chat_follow_vllm_fields(smollm2_server, fields, check):
    completion = _post(
        smollm2_server, "/v1/completions",
        {"prompt": "The review 'great film' is", "max_tokens": 20, "temperature": 0, **fields},
    ).json()  # fmt: skip
    assert re.fullmatch(check, completion["choices"][0]["text"]), completion
    chat = _post(smollm2_server, "/v1/chat/completions", _chat("Answer.", max_tokens=20, **fields))
    assert re.fullmatch(check, chat.json()["choices"][0]["message"]["content"]), chat.text


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "string", "format": "no-such"}}}},
            "response_format", "Unknown format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs", "unclosed group"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "GBNF grammar is invalid"),
        ({"guided_json": "{bad"}, "guided_json", "not valid JSON"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
         "exactly one of"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "not 2"),
        ({"response_format": {"type": "xml"}}, "response_format", "'json_schema' (got 'xml')"),
    ],
)  # fmt: skip
def test_bad_constraints_answer_400_naming_the_field(smollm2_server, fields, param, words):
    for route, body in (
        ("/v1/chat/completions", _chat("Hi", max_tokens=4, **fields)),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, **fields}),
    ):
        response = _post(smollm2_server, route, body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert words in error["message"], error
        assert (error.get("param") or "").startswith(param), error
    ok = _post(smollm2_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_grammar_refused_by_the_engine_is_a_400(smollm2_server, stream):
    """A grammar whose special tokens only the model's vocabulary can check (llguidance
    compiles it in the engine core): a 400 with the reason (in the stream: an error event
    with code 400), and the server serves on."""
    body = _chat("Hi", max_tokens=4, structured_outputs={"grammar": "start: <|no_such|>"})
    response = _post(smollm2_server, "/v1/chat/completions", {**body, "stream": stream})
    if stream:
        events = [json.loads(line[6:]) for line in response.text.splitlines()
                  if line.startswith("data: {")]  # fmt: skip
        error = events[-1]["error"]
        assert error["code"] == 400, events
    else:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
    assert 'unknown special token: "<|no_such|>"' in error["message"], error
    ok = _post(smollm2_server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200
