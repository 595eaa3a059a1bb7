"""text-embeddings-inference's own routes, in TEI's request, response and error shapes, so that
clients written for TEI point at cenote unchanged: POST /embed, /embed_all, /predict,
/similarity, /decode, GET /info, and POST / (the served model's route, as TEI picks it).
``/rerank`` and ``/tokenize`` answer TEI's bodies on the paths they share with other APIs
(routes_scoring.py, app.py); ``/embed_sparse`` is routes_sparse.py. Each route only translates:
the inputs run through the same ``pool`` as every pooling route."""

from __future__ import annotations

from typing import Any

import msgspec
import torch
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

import cenote
from cenote.engine.scoring import cosine_scores
from cenote.server.body import TEIRoute
from cenote.server.errors import BadRequest, EmptyBatch, WrongModelType
from cenote.server.pooling import pool
from cenote.server.protocol import PoolingRequest
from cenote.server.responses import any_of, tei_schema
from cenote.server.routes_scoring import tei_rerank
from cenote.server.routes_sparse import SparseEmbedRequest, embed_sparse
from cenote.server.served_models import get_state
from cenote.server.state import ServerState, with_cancellation
from cenote.server.tei_protocol import (
    TEIDecodeRequest,
    TEIDecodeResponse,
    TEIEmbedAllRequest,
    TEIEmbedAllResponse,
    TEIEmbedRequest,
    TEIEmbedResponse,
    TEIInfo,
    TEIPredictRequest,
    TEIPredictResponse,
    TEIRerankRequest,
    TEISimilarityParameters,
    TEISimilarityRequest,
    TEISimilarityResponse,
    TEITokenizeRequest,
    embed_prompts,
    predict_prompts,
    require_task,
)

router = APIRouter(route_class=TEIRoute)

# paths only TEI's API uses: the front door answers their errors in TEI's shape too
TEI_PATHS = frozenset({"/", "/embed", "/embed_all", "/predict", "/similarity", "/decode", "/info"})
_INLINE_RESPONSE_VALUES = 1 << 14  # larger responses are encoded off the event loop


def _json(value: Any) -> Response:
    return Response(msgspec.json.encode(value), media_type="application/json")


async def _vectors(state: ServerState, tensors: list[torch.Tensor]) -> Response:
    """The tensors as (nested) JSON lists of their fp32 values, built off the event loop when
    they hold many numbers."""

    def build() -> bytes:
        return msgspec.json.encode([t.float().tolist() for t in tensors])

    if sum(t.numel() for t in tensors) <= _INLINE_RESPONSE_VALUES:
        return Response(build(), media_type="application/json")
    return Response(await state.offload(build), media_type="application/json")


@router.post("/embed", responses=tei_schema(TEIEmbedResponse))
@with_cancellation
async def embed(body: TEIEmbedRequest, raw_request: Request) -> Response:
    return await _embed(body, await get_state(raw_request, task="embed"))


async def _embed(body: TEIEmbedRequest, state: ServerState) -> Response:
    require_task(state, "embed", "/embed", "an embedding model")
    request = PoolingRequest(
        normalize=body.normalize,
        dimensions=body.dimensions,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side,
        prompt_name=body.prompt_name,
    )
    outputs, _ = await pool(state, request, "embed", "embd", embed_prompts(body.inputs))
    return await _vectors(state, [out.outputs.data for out in outputs])


@router.post("/embed_all", responses=tei_schema(TEIEmbedAllResponse))
@with_cancellation
async def embed_all(body: TEIEmbedAllRequest, raw_request: Request) -> Response:
    """Every token's embedding (the special tokens' too), as the model's last layer gives it:
    not normalized, as TEI's."""
    state = await get_state(raw_request, task="token_embed")
    require_task(state, "token_embed", "/embed_all", "a model with token embeddings")
    request = PoolingRequest(
        normalize=False,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side,
        prompt_name=body.prompt_name,
    )
    outputs, _ = await pool(state, request, "token_embed", "embd", embed_prompts(body.inputs))
    return await _vectors(state, [out.outputs.data for out in outputs])  # [num_tokens, hidden]


@router.post("/predict", responses=tei_schema(TEIPredictResponse))
@with_cancellation
async def predict(body: TEIPredictRequest, raw_request: Request) -> Response:
    return await _predict(body, await get_state(raw_request, task="classify"))


async def _predict(body: TEIPredictRequest, state: ServerState) -> Response:
    """Every label's score, best first (ties in label order); the model's activation unless
    ``raw_scores``. A pair is read as a cross-encoder pair."""
    require_task(state, "classify", "/predict", "a classifier")
    prompts, is_batch = predict_prompts(body.inputs)
    request = PoolingRequest(
        use_activation=not body.raw_scores,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side,
    )
    outputs, _ = await pool(state, request, "classify", "classify", prompts)
    predictions = []
    for out in outputs:
        scores = out.outputs.data.float().tolist()
        names = out.outputs.label_names or [f"LABEL_{i}" for i in range(len(scores))]
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        predictions.append([{"score": scores[i], "label": names[i]} for i in order])
    return _json(predictions if is_batch else predictions[0])


@router.post("/similarity", responses=tei_schema(TEISimilarityResponse))
@with_cancellation
async def similarity(body: TEISimilarityRequest, raw_request: Request) -> Response:
    return await _similarity(body, await get_state(raw_request, task="embed"))


async def _similarity(body: TEISimilarityRequest, state: ServerState) -> Response:
    """Cosine similarity (fp32) of the source sentence's embedding with each sentence's."""
    require_task(state, "embed", "/similarity", "an embedding model")
    sentences = body.inputs.sentences
    if not sentences:
        raise EmptyBatch("`inputs.sentences` cannot be empty: send at least one sentence")
    parameters = body.parameters or TEISimilarityParameters()
    request = PoolingRequest(
        truncate_prompt_tokens=parameters.truncate_prompt_tokens,
        truncation_side=parameters.truncation_side,
        prompt_name=parameters.prompt_name,
    )
    texts = [body.inputs.source_sentence, *sentences]
    for i, text in enumerate(texts):
        if not text:
            name = f"inputs.sentences[{i - 1}]" if i else "inputs.source_sentence"
            raise BadRequest(f"{name} is an empty string", param="inputs")
    outputs, _ = await pool(state, request, "embed", "embd", list(texts))
    source, *others = [out.outputs.data for out in outputs]
    return _json(cosine_scores([source] * len(others), others))


@router.post("/decode", responses=tei_schema(TEIDecodeResponse))
async def decode(body: TEIDecodeRequest, raw_request: Request) -> Response:
    state = await get_state(raw_request)
    ids = body.ids
    # [] is one empty id list (its text is ""), as TEI reads it
    batch: list[list[int]] = [ids] if not ids or isinstance(ids[0], int) else ids  # type: ignore[list-item]
    limit, vocab = state.options.max_inputs, state.model_config.vocab_size
    if len(batch) > limit:
        raise BadRequest(f"got {len(batch)} id lists, the limit per request is {limit}", "ids")
    for i, row in enumerate(batch):
        bad = [t for t in row if not 0 <= t < vocab]
        if bad:
            raise BadRequest(
                f"ids[{i}] has token ids {bad[:5]} outside the vocabulary (size {vocab})", "ids"
            )
    texts = await state.offload(
        state.tokenizer.decode_batch, batch, skip_special_tokens=body.skip_special_tokens
    )
    return _json(texts)


def tei_tokenize(state: ServerState, body: TEITokenizeRequest) -> list[list[dict[str, Any]]]:
    """TEI's /tokenize: per input, its tokens with their spans (UTF-8 byte offsets into the
    text with the model's prompt in front, as TEI gives them); special tokens have no span."""
    texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
    if not texts:
        raise EmptyBatch("`inputs` cannot be empty: send a text or a batch of texts")
    state.check_texts(texts, "inputs")
    instruction = state.processor().prompts.instruction(body.prompt_name, None)
    texts = [instruction + text for text in texts]
    encodings = state.tokenizer.encode_batch(texts, add_special_tokens=body.add_special_tokens)
    results = []
    for text, encoding in zip(texts, encodings, strict=True):
        byte_at = _byte_offsets(text)
        tokens = []
        for token_id, (start, stop), special, token in zip(
            encoding.ids, encoding.offsets, encoding.special_tokens_mask, encoding.tokens,
            strict=True,
        ):  # fmt: skip
            if special:
                tokens.append({"id": token_id, "text": token, "special": True,
                               "start": None, "stop": None})  # fmt: skip
            else:
                tokens.append({"id": token_id, "text": text[start:stop], "special": False,
                               "start": byte_at[start], "stop": byte_at[stop]})  # fmt: skip
        results.append(tokens)
    return results


def _byte_offsets(text: str) -> list[int]:
    """The UTF-8 byte offset of each character position of ``text`` (and of its end)."""
    offsets, position = [0], 0
    for char in text:
        position += len(char.encode("utf-8", "surrogatepass"))
        offsets.append(position)
    return offsets


@router.get("/info", responses=tei_schema(TEIInfo))
async def info(raw_request: Request) -> JSONResponse:
    """The served model and this server's limits, in TEI's shape."""
    state = await get_state(raw_request)
    engine, options = state.engine_config, state.options
    max_running = engine.scheduler.max_num_seqs
    return JSONResponse(
        {
            "model_id": state.model_name,
            "model_sha": None,
            "model_dtype": str(state.model_config.dtype).removeprefix("torch."),
            "served_model_name": state.model_name,
            "model_type": _model_type(state),
            "max_concurrent_requests": max_running + options.max_waiting_requests,
            "max_input_length": state.model_config.max_model_len,
            "max_batch_tokens": engine.scheduler.max_num_batched_tokens,
            "max_batch_requests": max_running,
            "max_client_batch_size": options.max_inputs,
            "auto_truncate": options.auto_truncate,
            "tokenization_workers": options.blocking_threads,
            "version": cenote.__version__,
            "sha": None,
            "docker_label": None,
        }
    )


def _model_type(state: ServerState) -> dict[str, Any] | None:
    """TEI's kind of the model: a classifier (a reranker when it has one label) or an
    embedding model with its pooling; None for a model that only generates."""
    capabilities = state.client.capabilities
    if capabilities is None:
        return None
    tasks = capabilities.supported_tasks
    if "classify" in tasks:
        num_labels = capabilities.num_labels or 0
        names = capabilities.label_names or [f"LABEL_{i}" for i in range(num_labels)]
        labels = {"id2label": {str(i): name for i, name in enumerate(names)},
                  "label2id": {name: i for i, name in enumerate(names)}}  # fmt: skip
        return {"reranker" if num_labels == 1 else "classifier": labels}
    if "embed" in tasks:  # BGE-M3 embeds (CLS) and embeds sparse: POST / embeds, as here
        # a pooling whose windows cannot be joined (ColBERT) is named by how the model scores
        pooling = capabilities.chunkable_pooling or capabilities.score_type or "unknown"
        return {"embedding": {"pooling": pooling}}
    if "embed_sparse" in tasks:
        return {"embedding": {"pooling": "splade"}}
    return None


@router.post(
    "/",
    responses=tei_schema(None, ("TEIEmbedResponse", "TEIEmbedSparseResponse",
                                "TEIPredictResponse", "TEIRerankResponse", "TEISimilarityResponse")),
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": any_of("TEIEmbedRequest", "TEIPredictRequest", "TEIRerankRequest",
                         "TEISimilarityRequest")}}}},
)  # fmt: skip
async def root(raw_request: Request) -> Response:
    """TEI's POST /: the served model's route, as TEI picks it (what Hugging Face's
    ``InferenceClient(base_url).feature_extraction`` calls): ``query`` + ``texts``: rerank;
    ``inputs`` with ``source_sentence``: similarity; otherwise by the (first) model's tasks:
    embeddings, sparse embeddings or classification."""
    state = await get_state(raw_request)
    body = await raw_request.json()
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    tasks = state.supported_tasks
    try:
        if "query" in body and "texts" in body:
            return await tei_rerank(TEIRerankRequest.model_validate(body), raw_request=raw_request)  # type: ignore[no-any-return]
        if isinstance(body.get("inputs"), dict):
            similarity = TEISimilarityRequest.model_validate(body)
            return await _similarity(similarity, await get_state(raw_request, task="embed"))
        if "embed" in tasks:
            return await _embed(TEIEmbedRequest.model_validate(body), state)
        if "embed_sparse" in tasks:
            sparse = SparseEmbedRequest.model_validate(body)
            response: Response = await embed_sparse(sparse, raw_request=raw_request)
            return response
        if "classify" in tasks:
            return await _predict(TEIPredictRequest.model_validate(body), state)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    raise WrongModelType(
        f"POST / serves embedding, classification and reranking models; {state.model_name} "
        f"serves {', '.join(tasks) or 'no pooling task'}"
    )
