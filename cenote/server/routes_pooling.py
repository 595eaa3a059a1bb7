"""POST /v1/embeddings (OpenAI shape) and POST /pooling (vLLM shape); the pooling helpers the
scoring routes share."""

from __future__ import annotations

import base64
import time

import msgspec
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from cenote.outputs import EmbeddingOutput, PoolingOutput, PoolingRequestOutput
from cenote.pooling_params import PoolingParams
from cenote.server.protocol import EmbeddingRequest, PoolingRequest, _PoolingBody
from cenote.server.state import ServerState, get_state, new_request_id, with_cancellation
from cenote.tasks import POOLING_TASKS, PoolingTask

router = APIRouter()


@router.post("/v1/embeddings")
@with_cancellation
async def create_embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    outputs, request_id = await pool(state, body, "embed", "embd", EmbeddingOutput)
    data = [
        {"object": "embedding", "index": i, "embedding": _encode(out.outputs.data, body)}
        for i, out in enumerate(outputs)
    ]
    return list_response(state, request_id, data, outputs)


@router.post("/pooling")
@with_cancellation
async def create_pooling(body: PoolingRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    task = body.task or _default_pooling_task(state)
    outputs, request_id = await pool(state, body, task, "pool", PoolingOutput)
    data = [
        {"object": "pooling", "index": i, "data": _encode(out.outputs.data, body)}
        for i, out in enumerate(outputs)
    ]
    return list_response(state, request_id, data, outputs)


def _default_pooling_task(state: ServerState) -> PoolingTask:
    tasks = [t for t in state.supported_tasks if t in POOLING_TASKS]
    return "embed" if "embed" in tasks or not tasks else tasks[0]


async def pool(
    state: ServerState, body: _PoolingBody, task: PoolingTask, prefix: str, output_class: type
) -> tuple[list[PoolingRequestOutput], str]:
    """Run ``task`` on each input of ``body``; outputs in input order, and the request id."""
    # 1) validate: model, task, inputs, options
    processor = state.processor()
    state.check_model(body.model)
    state.check_task(task)
    prompts = state.prompts_from(body.input, body.messages, add_generation_prompt=False)
    state.check_capacity(len(prompts))
    params = PoolingParams(
        task=task,
        dimensions=body.dimensions,
        normalize=body.normalize,
        use_activation=body.use_activation,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )
    processor.check_pooling_params(params)
    # 2) tokenize (here, in the front process), 3) run in the core
    tokenized = processor.tokenize(
        prompts, body.truncate_prompt_tokens, add_special_tokens=body.add_special_tokens
    )
    request_id = new_request_id(prefix, body.request_id)
    requests = [
        processor.make_request(
            f"{request_id}-{i}", tok, pooling_params=params, priority=body.priority
        )
        for i, tok in enumerate(tokenized)
    ]
    outputs = await state.run_pooling(requests, [t.prompt for t in tokenized], output_class)
    return outputs, request_id


def _encode(data: torch.Tensor, body: _PoolingBody) -> list | str:
    """float: (nested) lists; base64: little-endian float32 bytes, like OpenAI."""
    data = data.float()
    if body.encoding_format == "base64":
        return base64.b64encode(data.numpy().astype("<f4").tobytes()).decode("ascii")
    return data.tolist()


def list_response(
    state: ServerState, request_id: str, data: list[dict], outputs: list[PoolingRequestOutput]
) -> Response:
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    body = {
        "id": request_id,
        "object": "list",
        "created": int(time.time()),
        "model": state.model_name,
        "data": data,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
    return json_response(body)


def json_response(body: dict) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")
