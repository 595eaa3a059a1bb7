"""Sparse (SPLADE) embeddings over HTTP: POST /embed_sparse in text-embeddings-inference's shape
(one list of ``{index, value}`` (token id, weight) per input, in index order), and
``/v1/embeddings`` with ``sparse: true`` (``embedding: {indices, values}``, a cenote extension)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from cenote.outputs import SparseEmbeddingOutput
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest
from cenote.server.pooling import list_response, pool
from cenote.server.protocol import EmbeddingRequest, PoolingRequest, PromptInput, _Body
from cenote.server.responses import schema
from cenote.server.served_models import get_state
from cenote.server.state import ServerState, with_cancellation

router = APIRouter(route_class=JSONRoute)


class SparseEmbedRequest(_Body):
    """POST /embed_sparse (TEI)."""

    inputs: PromptInput  # one or many texts (or token-id lists)
    truncate: bool | None = None  # cut inputs to the model's limit; None: the server's default
    truncation_direction: Literal["right", "left", "Right", "Left"] = "right"
    prompt_name: str | None = None  # one of the model's prompts before each text


@router.post("/embed_sparse", responses=schema(None))
@with_cancellation
async def embed_sparse(body: SparseEmbedRequest, raw_request: Request) -> JSONResponse:
    state = await get_state(raw_request, task="embed_sparse")
    # TEI's body as the shared pooling body: one path for every pooling route
    request = PoolingRequest(
        input=body.inputs,
        truncate_prompt_tokens=-1 if body.truncate else None,
        truncation_side="left" if body.truncation_direction.lower() == "left" else "right",
        prompt_name=body.prompt_name,
    )
    outputs, _ = await pool(state, request, "embed_sparse", "sparse")
    return JSONResponse([_sparse_values(out.outputs) for out in outputs])


def _sparse_values(output: SparseEmbeddingOutput) -> list[dict[str, float]]:
    ids = output.data.nonzero().flatten()  # ascending token ids, as TEI lists them
    return [
        {"index": i, "value": v}
        for i, v in zip(ids.tolist(), output.data[ids].tolist(), strict=True)
    ]


async def sparse_embeddings(state: ServerState, body: EmbeddingRequest) -> Response:
    """``/v1/embeddings`` with ``sparse: true``: each item's ``embedding`` is
    ``{"indices": [token ids, ascending], "values": [weights]}``."""
    if body.encoding_format != "float":
        raise BadRequest(
            "sparse embeddings are answered as JSON index/value lists: encoding_format must be "
            f"'float', got {body.encoding_format!r}",
            "encoding_format",
        )
    outputs, request_id = await pool(state, body, "embed_sparse", "embd")
    data = []
    for i, out in enumerate(outputs):
        entries = _sparse_values(out.outputs)
        embedding = {
            "indices": [e["index"] for e in entries],
            "values": [e["value"] for e in entries],
        }
        data.append({"object": "embedding", "index": i, "embedding": embedding})
    return list_response(state, request_id, data, outputs, body.model)
