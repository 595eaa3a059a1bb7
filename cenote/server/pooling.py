"""The pooling step every pooling route shares (/v1/embeddings, /pooling, /embed_sparse, the
scoring, TEI and Cohere routes): a body validated, tokenized and run in the engine, and the
OpenAI-shaped list response of its outputs."""

from __future__ import annotations

import time
from typing import Any

import msgspec
from fastapi.responses import Response

from cenote.engine.input_processor import ParentRequest
from cenote.inputs import PromptType
from cenote.outputs import PoolingRequestOutput
from cenote.pooling_params import PoolingParams
from cenote.server import timing
from cenote.server.protocol import _PoolingBody
from cenote.server.state import ServerState, new_request_id
from cenote.tasks import PoolingTaskSelection


async def pool(
    state: ServerState,
    body: _PoolingBody,
    task: PoolingTaskSelection,
    prefix: str,
    prompts: list[PromptType] | None = None,
) -> tuple[list[PoolingRequestOutput[Any]], str]:
    """Run ``task`` on each input of ``body`` (or on ``prompts``, inputs a route has read from
    its own format: TEI's pairs and mixed batches); outputs in input order, and the request
    id."""
    # 1) validate and tokenize, off the event loop; 2) run in the core
    with timing.tokenization():
        requests, request_id = await state.offload(_prepare, state, body, task, prefix, prompts)
    timing.record_request_id(request_id)
    # a multi-task request (BGE-M3's three outputs) is labelled by its tasks joined: embed+...
    label = task if isinstance(task, str) else "+".join(task)
    outputs = await state.run_pooling(requests, label)
    return outputs, request_id


def _prepare(
    state: ServerState,
    body: _PoolingBody,
    task: PoolingTaskSelection,
    prefix: str,
    prompts: list[PromptType] | None,
) -> tuple[list[ParentRequest], str]:
    """The requests of ``body`` (validated, tokenized) and the request id."""
    processor = state.processor()
    adapter = state.check_model(body.model)
    if prompts is None:
        prompts = body.prompts()
    state.check_prompts(prompts)
    state.check_capacity(len(prompts))
    options = state.options
    capabilities = state.client.capabilities
    assert capabilities is not None, "the core reports its capabilities before serving"
    # the server's --long-input chunk: for models whose embeddings can be joined
    long_input = options.long_input if capabilities.chunkable_pooling else "error"
    params = body.to_pooling_params(task, options.auto_truncate, long_input, options.chunk_overlap)
    request_id = new_request_id(prefix, body.request_id)  # echoed to the client
    engine_id = new_request_id(prefix)  # the engine's key: never taken from the client
    requests = processor.process_batch(
        [f"{engine_id}-{i}" for i in range(len(prompts))], prompts, params,
        priority=body.priority, add_special_tokens=body.add_special_tokens,
        lora_request=adapter,
    )  # fmt: skip
    num_tokens = sum(len(r.prompt_token_ids) for r in requests)
    state.check_request_tokens(num_tokens)
    for one in params.tasks:  # a multi-task request: each task's output is bounded alike
        if one in ("token_embed", "token_classify"):
            width = _output_width(state, params.for_task(one))
            state.check_response_values(num_tokens * width, f"{num_tokens} tokens x {width}")
        if one == "embed_sparse":  # up to one weight per vocabulary entry and input
            vocab = state.model_config.vocab_size
            state.check_response_values(len(requests) * vocab, f"{len(requests)} inputs x {vocab}")
    return requests, request_id


def _output_width(state: ServerState, params: PoolingParams) -> int:
    """Numbers per token of a token-level output (``params``: one task's)."""
    capabilities = state.client.capabilities
    assert capabilities is not None, "the core reports its capabilities before serving"
    if params.task == "token_embed":
        return params.dimensions or capabilities.embedding_size or 1
    return capabilities.num_labels or 1


def list_response(
    state: ServerState,
    request_id: str,
    data: list[dict[str, Any]],
    outputs: list[PoolingRequestOutput[Any]],
    model: str | None,  # the body's ``model``: echoed when it names an adapter
) -> Response:
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    body = {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": state.echoed_model(model),
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    return json_response(body)


def json_response(body: dict[str, Any] | list[Any]) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")
