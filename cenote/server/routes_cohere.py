"""POST /v2/embed in Cohere Embed v2's shape: ``texts`` with an ``input_type`` that picks the
model's instruction prompt, ``embedding_types`` (float, int8, uint8, binary, ubinary, base64)
answered side by side, ``truncate`` NONE / START / END, ``output_dimension``."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from cenote.pooling.quantize import quantize_embeddings
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest
from cenote.server.pooling import json_response, pool
from cenote.server.protocol import Int64, PoolingRequest, PositiveCount, _Body
from cenote.server.responses import CohereEmbedResponse, schema
from cenote.server.state import ServerState, get_state, with_cancellation

router = APIRouter(route_class=JSONRoute)

InputType = Literal["search_query", "search_document", "classification", "clustering", "image"]
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereEmbedRequest(_Body):
    """POST /v2/embed (Cohere Embed v2)."""

    model: str | None = None
    input_type: InputType
    texts: Annotated[list[str], Field(min_length=1)]  # Cohere's images / inputs: not served
    images: list[str] | None = None  # refused: text models only
    inputs: list[Any] | None = None  # mixed text / image contents: refused
    embedding_types: Annotated[list[EmbeddingType], Field(min_length=1)] | None = None
    output_dimension: PositiveCount | None = None  # matryoshka truncation
    max_tokens: PositiveCount | None = None  # cut each text to this many tokens (truncate side)
    truncate: Literal["NONE", "START", "END"] = "END"
    priority: Int64 = 0


@router.post("/v2/embed", responses=schema(CohereEmbedResponse))
@with_cancellation
async def create_embed_v2(body: CohereEmbedRequest, raw_request: Request) -> Response:
    state = await get_state(raw_request, body.model, "embed")
    # 1) Cohere's fields as the shared pooling body: one path with every pooling route
    request = _pooling_request(state, body)
    types = list(dict.fromkeys(body.embedding_types or ["float"]))  # once each, in order
    outputs, request_id = await pool(state, request, "embed", "embd")

    # 2) every asked type of the same float embeddings (large responses built off the loop)
    def build() -> Response:
        floats = torch.stack([out.outputs.data.float() for out in outputs]).numpy()
        embeddings = {kind: _encode(floats, kind) for kind in types}
        num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
        return json_response(
            {
                "id": request_id,
                "response_type": "embeddings_by_type",
                "embeddings": embeddings,
                "texts": body.texts,
                "meta": {
                    "api_version": {"version": "2"},
                    "billed_units": {"input_tokens": num_tokens},
                },
            }
        )

    return await state.offload(build)


def _pooling_request(state: ServerState, body: CohereEmbedRequest) -> PoolingRequest:
    if body.images is not None or body.inputs is not None or body.input_type == "image":
        raise BadRequest(
            "this server embeds texts: pass texts (images and mixed inputs are not served)",
            param="images" if body.images is not None else "inputs",
        )
    prompt_name, prompt = _prompt_of(state, body.input_type)
    truncate: int | None = None
    if body.truncate != "NONE":  # Cohere's default END: cut the end to fit
        truncate = body.max_tokens if body.max_tokens is not None else -1
    return PoolingRequest(
        model=body.model,
        input=body.texts,
        dimensions=body.output_dimension,
        truncate_prompt_tokens=truncate,
        truncation_side="left" if body.truncate == "START" else "right",
        prompt_name=prompt_name,
        prompt=prompt,
        priority=body.priority,
    )


def _prompt_of(state: ServerState, input_type: str) -> tuple[str | None, str | None]:
    """(prompt_name, literal prompt) of ``input_type``: the server's --input-type-prompts, else
    the first of the model's prompts named for it, else neither (the model's default)."""
    configured = state.options.input_type_prompts or {}
    if input_type in configured:
        return None, configured[input_type]
    role = input_type.removeprefix("search_")  # search_query -> the query prompt
    return state.processor().prompts.role_prompt_name(role, input_type), None


def _encode(floats: np.ndarray, kind: str) -> list[Any]:
    """One embedding type of ``floats`` (``[num, dim]``). int8 / uint8 use the fixed range
    [-1, 1] in every dimension (where every component of a unit vector lies), so a vector's
    values never depend on the other texts of its request."""
    if kind == "float":
        return floats.tolist()  # type: ignore[no-any-return]
    if kind == "base64":  # float32, little-endian, as Cohere's clients decode it
        return [base64.b64encode(row.astype("<f4").tobytes()).decode("ascii") for row in floats]
    ranges = None
    if kind in ("int8", "uint8"):
        width = floats.shape[1]
        ranges = np.stack([np.full(width, -1.0), np.full(width, 1.0)]).astype(np.float32)
    return quantize_embeddings(floats, kind, ranges=ranges).tolist()  # type: ignore[arg-type,no-any-return]
