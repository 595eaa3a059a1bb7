"""POST /embed_sparse, text-embeddings-inference's shape: one list of ``{index, value}`` (token
id, weight) per input, in index order, for sparse (SPLADE) models."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from cenote.outputs import SparseEmbeddingOutput
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest
from cenote.server.protocol import PoolingRequest, PromptInput, _Body
from cenote.server.responses import schema
from cenote.server.routes_pooling import pool
from cenote.server.state import get_state, with_cancellation

router = APIRouter(route_class=JSONRoute)


class SparseEmbedRequest(_Body):
    """POST /embed_sparse (TEI)."""

    inputs: PromptInput  # one or many texts (or token-id lists)
    truncate: bool | None = None  # cut inputs to the model's limit; None: the server's default
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: str | None = None  # TEI's prompt selection: refused (the default prompt is used)


@router.post("/embed_sparse", responses=schema(None))
@with_cancellation
async def embed_sparse(body: SparseEmbedRequest, raw_request: Request) -> JSONResponse:
    state = get_state(raw_request)
    if body.prompt_name is not None:
        raise BadRequest(
            "prompt_name is not supported; the model's default prompt is used", "prompt_name"
        )
    # TEI's body as the shared pooling body: one path for every pooling route
    request = PoolingRequest(
        input=body.inputs,
        truncate_prompt_tokens=-1 if body.truncate else None,
        truncation_side=body.truncation_direction.lower(),
    )
    outputs, _ = await pool(state, request, "embed_sparse", "sparse", SparseEmbeddingOutput)
    return JSONResponse([_sparse_values(out.outputs) for out in outputs])


def _sparse_values(output: SparseEmbeddingOutput) -> list[dict[str, float]]:
    ids = output.data.nonzero().flatten()  # ascending token ids, as TEI lists them
    return [
        {"index": i, "value": v}
        for i, v in zip(ids.tolist(), output.data[ids].tolist(), strict=True)
    ]
