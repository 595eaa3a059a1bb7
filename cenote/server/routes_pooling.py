"""POST /v1/embeddings (OpenAI shape) and POST /pooling (vLLM shape)."""

from __future__ import annotations

import base64
import sys
import time
from typing import Any

import msgspec
import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response

from cenote.outputs import MultiTaskOutput, PoolingOutput, PoolingRequestOutput
from cenote.pooling.quantize import Precision, quantize_embeddings
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest
from cenote.server.pooling import list_response, pool
from cenote.server.protocol import EmbeddingRequest, PoolingRequest, _PoolingBody
from cenote.server.responses import EmbeddingResponse, PoolingResponse, schema
from cenote.server.routes_sparse import sparse_embeddings
from cenote.server.served_models import get_state
from cenote.server.state import ServerState, with_cancellation
from cenote.tasks import POOLING_TASKS, PoolingTask

router = APIRouter(route_class=JSONRoute)

_INLINE_RESPONSE_VALUES = 1 << 14  # larger responses are encoded off the event loop
# the metadata header's bound: with the other headers, well inside nginx's 4 KiB proxy buffer
_METADATA_HEADER_BYTES = 2048
_EMBED_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@router.post("/v1/embeddings", responses=schema(EmbeddingResponse, binary=True))
@with_cancellation
async def create_embeddings(body: EmbeddingRequest, raw_request: Request) -> Response:
    state = await get_state(raw_request, body.model, "embed_sparse" if body.sparse else "embed")
    if body.encoding_format in QUANTIZED:
        return await quantized_embeddings(state, body)
    if body.sparse:  # cenote extension: sparse embeddings (routes_sparse.py)
        return await sparse_embeddings(state, body)
    if body.quantization_ranges is not None:
        raise BadRequest(
            "quantization_ranges applies to encoding_format 'int8' or 'uint8', not "
            f"{body.encoding_format!r}",
            param="quantization_ranges",
        )
    outputs, request_id = await pool(state, body, "embed", "embd")
    return await respond(state, request_id, outputs, body, "embedding")


QUANTIZED: dict[str, Precision] = {"int8": "int8", "uint8": "uint8", "binary": "binary",
                                   "ubinary": "ubinary"}  # fmt: skip


async def quantized_embeddings(state: ServerState, body: EmbeddingRequest) -> Response:
    """``encoding_format`` int8 / uint8 / binary / ubinary: the embeddings as
    sentence-transformers' ``quantize_embeddings`` gives them (lists of integers; binary ones
    packed 8 dimensions to a byte). int8 / uint8 take ``quantization_ranges`` or, without them,
    the ranges of the request's own inputs (so at least two)."""
    precision = QUANTIZED[body.encoding_format]
    if body.sparse:
        raise BadRequest(
            f"encoding_format {precision!r} applies to dense embeddings, not sparse ones",
            param="encoding_format",
        )
    if body.embed_dtype != "float32":
        raise BadRequest(
            f"embed_dtype applies to encoding_format 'base64' or 'bytes', not {precision!r}",
            param="embed_dtype",
        )
    ranges = None
    if precision in ("int8", "uint8"):
        capabilities = state.client.capabilities
        assert capabilities is not None, "the core reports its capabilities before serving"
        width = body.dimensions or capabilities.embedding_size or 0
        if body.quantization_ranges is not None:
            ranges = np.asarray(body.quantization_ranges, dtype=np.float32)
            if len(body.quantization_ranges) != 2 or any(
                len(row) != width for row in body.quantization_ranges
            ):
                raise BadRequest(
                    f"quantization_ranges must be [[min] * {width}, [max] * {width}] (the "
                    f"embedding size); got {len(body.quantization_ranges)} rows of "
                    f"{[len(row) for row in body.quantization_ranges][:4]} values",
                    param="quantization_ranges",
                )
        elif len(body.prompts()) < 2:
            raise BadRequest(
                f"encoding_format {precision!r} needs quantization_ranges, or at least 2 inputs "
                "to take the ranges from; got 1 input",
                param="quantization_ranges",
            )
    elif body.quantization_ranges is not None:
        raise BadRequest(
            f"quantization_ranges applies to encoding_format 'int8' or 'uint8', not {precision!r}",
            param="quantization_ranges",
        )
    outputs, request_id = await pool(state, body, "embed", "embd")

    def build() -> Response:
        stacked = torch.stack([out.outputs.data.float() for out in outputs])
        values = quantize_embeddings(stacked, precision, ranges=ranges).tolist()
        data = [
            {"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(values)
        ]
        return list_response(state, request_id, data, outputs, body.model)

    return await state.offload(build)


@router.post("/pooling", responses=schema(PoolingResponse, binary=True))
@with_cancellation
async def create_pooling(body: PoolingRequest, raw_request: Request) -> Response:
    if body.encoding_format in QUANTIZED:
        raise BadRequest(
            f"encoding_format {body.encoding_format!r} is served on /v1/embeddings; /pooling "
            "answers float, base64 or bytes",
            param="encoding_format",
        )
    first_task = body.task
    if isinstance(first_task, list):  # several tasks: the model serving the first is asked
        first_task = first_task[0] if first_task else None
    state = await get_state(raw_request, body.model, first_task)
    task = body.task_selection(_default_pooling_task(state))
    if isinstance(task, tuple) and body.encoding_format == "bytes":
        raise BadRequest(
            f"encoding_format 'bytes' answers one tensor per input; a request for several "
            f"tasks {list(task)} answers float or base64",
            param="encoding_format",
        )
    outputs, request_id = await pool(state, body, task, "pool")
    return await respond(state, request_id, outputs, body, "pooling")


async def respond(
    state: ServerState,
    request_id: str,
    outputs: list[PoolingRequestOutput[Any]],
    body: _PoolingBody,
    object_name: str,
) -> Response:
    """The response body of embeddings ("embedding") or pooling ("pooling") outputs, built
    off the event loop when they are large (lists and JSON of millions of numbers would stall
    every other request)."""

    def build() -> Response:
        if body.encoding_format == "bytes":
            return bytes_response(state, request_id, outputs, body)
        key = "embedding" if object_name == "embedding" else "data"
        data = [
            {"object": object_name, "index": i, key: _encode_output(out.outputs, body)}
            for i, out in enumerate(outputs)
        ]
        return list_response(state, request_id, data, outputs, body.model)

    if sum(_num_values(out.outputs) for out in outputs) <= _INLINE_RESPONSE_VALUES:
        return build()
    return await state.offload(build)


def _encode_output(output: PoolingOutput | MultiTaskOutput, body: _PoolingBody) -> Any:
    """One input's ``data``: its tensor encoded, or for several tasks a task -> encoded map."""
    if isinstance(output, MultiTaskOutput):
        return {task: _encode(result.data, body) for task, result in output.by_task.items()}
    return _encode(output.data, body)


def _num_values(output: PoolingOutput | MultiTaskOutput) -> int:
    if isinstance(output, MultiTaskOutput):
        return sum(result.data.numel() for result in output.by_task.values())
    return output.data.numel()


def _default_pooling_task(state: ServerState) -> PoolingTask:
    tasks = [t for name in state.supported_tasks for t in POOLING_TASKS if t == name]
    return "embed" if "embed" in tasks or not tasks else tasks[0]


def _encode(data: torch.Tensor, body: _PoolingBody) -> list[Any] | str:
    """float: (nested) lists of the fp32 values; base64: ``embed_dtype`` values in
    ``endianness`` byte order (default: native float32, OpenAI's little-endian on x86)."""
    if body.encoding_format == "base64":
        return base64.b64encode(_raw_bytes(data, body)).decode("ascii")
    if body.embed_dtype != "float32":
        raise BadRequest(
            "embed_dtype applies to encoding_format 'base64' or 'bytes', not 'float'",
            param="embed_dtype",
        )
    return data.float().tolist()


def _raw_bytes(data: torch.Tensor, body: _PoolingBody) -> bytes:
    """The values as ``embed_dtype`` (bfloat16: its 2-byte pattern), flattened, in
    ``endianness`` byte order."""
    values = data.float().to(_EMBED_DTYPES[body.embed_dtype]).flatten().contiguous()
    if body.embed_dtype == "bfloat16":
        values = values.view(torch.int16)  # numpy has no bfloat16: move the bit patterns
    array = values.numpy()
    if body.endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return array.tobytes()


def bytes_response(
    state: ServerState,
    request_id: str,
    outputs: list[PoolingRequestOutput[Any]],
    body: _PoolingBody,
) -> Response:
    """``encoding_format: bytes`` (vLLM): the outputs' raw bytes back to back as the body, and a
    ``metadata`` header (JSON): id, model, usage and ``data``, each output's ``start``/``end``
    offsets, shape and dtype. When ``data`` would make the header longer than
    ``_METADATA_HEADER_BYTES`` it follows the raw bytes in the body instead, as JSON, and the
    header names its offsets (``data_start``, ``data_end``): clients and proxies refuse headers
    of a few KiB, and ``data`` takes ~100 bytes an output."""
    chunks, items, offset = [], [], 0
    for i, out in enumerate(outputs):
        raw = _raw_bytes(out.outputs.data, body)
        items.append(
            {"index": i, "embed_dtype": body.embed_dtype, "endianness": body.endianness,
             "start": offset, "end": offset + len(raw), "shape": list(out.outputs.data.shape)}
        )  # fmt: skip
        chunks.append(raw)
        offset += len(raw)
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    metadata: dict[str, Any] = {
        "id": request_id, "object": "list", "created": int(time.time()),
        "model": state.echoed_model(body.model), "data": items,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }  # fmt: skip
    header = msgspec.json.encode(metadata)
    if len(header) > _METADATA_HEADER_BYTES:
        data = msgspec.json.encode(metadata.pop("data"))
        chunks.append(data)
        metadata |= {"data_start": offset, "data_end": offset + len(data)}
        header = msgspec.json.encode(metadata)
    return Response(
        b"".join(chunks),
        media_type="application/octet-stream",
        headers={"metadata": header.decode()},
    )
