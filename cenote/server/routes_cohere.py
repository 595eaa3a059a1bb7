"""POST /v2/embed in Cohere Embed v2's shape: ``texts`` with an ``input_type`` that picks the
model's instruction prompt, ``images`` (data URIs) or ``inputs`` (one text or image_url content
part each) for models with a vision tower, ``embedding_types`` (float, int8, uint8, binary,
ubinary, base64) answered side by side, ``truncate`` NONE / START / END, ``output_dimension``.

Images take the path of ``/v1/embeddings``' images: each becomes an ``ImagePrompt`` that the input
processor opens under the server's media policy (``--max-image-pixels``,
``--allowed-local-media-path``, ``--allow-remote-media``). Cohere's Embed v4 fuses an input
mixing texts and images into one vector; a CLIP / SigLIP model has no such fusion (its towers
embed one text or one image into a shared space), so an input of several parts is refused."""

from __future__ import annotations

import base64
from typing import Annotated, Any, Literal

import numpy as np
import torch
from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import Field

from cenote.inputs import ImagePrompt, PromptType
from cenote.pooling.quantize import quantize_embeddings
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest
from cenote.server.pooling import json_response, pool
from cenote.server.protocol import Int64, PoolingRequest, PositiveCount, _Body
from cenote.server.responses import CohereEmbedResponse, schema
from cenote.server.served_models import get_state
from cenote.server.state import ServerState, with_cancellation

router = APIRouter(route_class=JSONRoute)

InputType = Literal["search_query", "search_document", "classification", "clustering", "image"]
EmbeddingType = Literal["float", "int8", "uint8", "binary", "ubinary", "base64"]


class CohereImageUrl(_Body):
    url: str  # a data: URI (file:// and http(s) as the server's media flags allow)


class CohereContent(_Body):
    """One part of an ``inputs`` item: ``{"type": "text", "text": ...}`` or
    ``{"type": "image_url", "image_url": {"url": ...}}``."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: CohereImageUrl | None = None


class CohereInput(_Body):
    content: Annotated[list[CohereContent], Field(min_length=1)]


class CohereEmbedRequest(_Body):
    """POST /v2/embed (Cohere Embed v2): exactly one of ``texts``, ``images``, ``inputs``."""

    model: str | None = None
    input_type: InputType
    texts: Annotated[list[str], Field(min_length=1)] | None = None
    images: Annotated[list[str], Field(min_length=1)] | None = None  # image URLs (data URIs)
    inputs: Annotated[list[CohereInput], Field(min_length=1)] | None = None
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
    prompts = cohere_prompts(body)
    request = _pooling_request(state, body)
    types = list(dict.fromkeys(body.embedding_types or ["float"]))  # once each, in order
    outputs, request_id = await pool(state, request, "embed", "embd", prompts)

    # 2) every asked type of the same float embeddings (large responses built off the loop)
    def build() -> Response:
        floats = torch.stack([out.outputs.data.float() for out in outputs]).numpy()
        embeddings = {kind: _encode(floats, kind) for kind in types}
        is_image = [isinstance(prompt, dict) for prompt in prompts]
        # an image's rows are placeholders, not tokens: Cohere bills images by count
        num_tokens = sum(
            len(out.prompt_token_ids) for out, image in zip(outputs, is_image, strict=True)
            if not image
        )  # fmt: skip
        billed: dict[str, int] = {"input_tokens": num_tokens}
        if any(is_image):
            billed["images"] = sum(is_image)
        return json_response(
            {
                "id": request_id,
                "response_type": "embeddings_by_type",
                "embeddings": embeddings,
                "texts": body.texts or [],
                "meta": {"api_version": {"version": "2"}, "billed_units": billed},
            }
        )

    return await state.offload(build)


def cohere_prompts(body: CohereEmbedRequest) -> list[PromptType]:
    """The body's texts, images or inputs as prompts, in order (an image an ``ImagePrompt`` of
    its URL, opened by the input processor as ``/v1/embeddings`` opens one)."""
    given = [name for name in ("texts", "images", "inputs") if getattr(body, name) is not None]
    if len(given) != 1:
        raise BadRequest(
            f"pass exactly one of texts, images and inputs (got {', '.join(given) or 'none'})",
            param="texts",
        )
    prompts: list[PromptType]
    if body.texts is not None:
        prompts = list(body.texts)
    elif body.images is not None:
        prompts = [ImagePrompt(image=url) for url in body.images]
    else:
        assert body.inputs is not None
        prompts = [_input_prompt(item, i) for i, item in enumerate(body.inputs)]
    if body.input_type == "image" and any(not isinstance(p, dict) for p in prompts):
        raise BadRequest(
            "input_type 'image' embeds images: pass images (or image_url inputs); texts take "
            "search_query, search_document, classification or clustering",
            param="input_type",
        )
    return prompts


def _input_prompt(item: CohereInput, index: int) -> PromptType:
    """One ``inputs`` item: exactly one text or one image_url part (a two-tower model embeds a
    text or an image; it has no fused embedding of both)."""
    parts = item.content
    if len(parts) != 1:
        num_images = sum(part.type == "image_url" for part in parts)
        raise BadRequest(
            f"inputs[{index}] holds {len(parts)} content parts ({len(parts) - num_images} text, "
            f"{num_images} image_url); this model embeds one text or one image per input, it "
            "has no fused embedding of several parts: send each part as its own input",
            param="inputs",
        )
    part = parts[0]
    if part.type == "text":
        if not part.text:
            raise BadRequest(f"inputs[{index}] is a text part without text", param="inputs")
        return part.text
    if part.image_url is None:
        raise BadRequest(
            f"inputs[{index}] is an image_url part without image_url: pass "
            "{'type': 'image_url', 'image_url': {'url': 'data:...'}}",
            param="inputs",
        )
    return ImagePrompt(image=part.image_url.url)


def _pooling_request(state: ServerState, body: CohereEmbedRequest) -> PoolingRequest:
    """The shared pooling body of the request's options (its prompts: ``cohere_prompts``)."""
    prompt_name, prompt = _prompt_of(state, body.input_type)
    truncate: int | None = None
    if body.truncate != "NONE":  # Cohere's default END: cut the end to fit
        truncate = body.max_tokens if body.max_tokens is not None else -1
    return PoolingRequest(
        model=body.model,
        dimensions=body.output_dimension,
        truncate_prompt_tokens=truncate,
        truncation_side="left" if body.truncate == "START" else "right",
        prompt_name=prompt_name,
        prompt=prompt,
        priority=body.priority,
    )


def _prompt_of(state: ServerState, input_type: str) -> tuple[str | None, str | None]:
    """(prompt_name, literal prompt) of ``input_type``: the server's --input-type-prompts, else
    the first of the model's prompts named for it, else neither (the model's default). An
    image takes no instruction: ``image`` names none."""
    if input_type == "image":
        return None, None
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
