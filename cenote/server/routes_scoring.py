"""POST /classify, /score + /v1/score (vLLM shapes), /rerank + /v1/rerank (Jina shape; /rerank
also text-embeddings-inference's) and /v2/rerank (Cohere shape). Scoring is planned by
``cenote.engine.scoring``, as in ``LLM.score``: cross-encoders read pairs, bi-encoders compare
embeddings (cosine), late interaction MaxSim. Models with a vision tower (CLIP, SigLIP) also
score images, sent in vLLM's multimodal shape (``protocol.ScoreInputs``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from pydantic import ValidationError

from cenote.engine.scoring import ScoreItem, ScorePlan, pair_score_inputs, plan_scores
from cenote.outputs import PoolingRequestOutput
from cenote.server import timing
from cenote.server.body import JSONRoute, answer_tei
from cenote.server.errors import EmptyBatch, WrongModelType
from cenote.server.pooling import json_response, list_response, pool
from cenote.server.protocol import (
    ClassificationRequest,
    RerankRequest,
    ScoreRequest,
    _ScoringBody,
    check_query,
)
from cenote.server.responses import (
    ClassificationResponse,
    RerankResponse,
    RerankV2Response,
    ScoreResponse,
    any_of,
    schema,
    shared_schema,
)
from cenote.server.served_models import SCORE_TASK, get_state
from cenote.server.state import ServerState, new_request_id, with_cancellation
from cenote.server.tei_protocol import TEIRerankRequest

router = APIRouter(route_class=JSONRoute)


@router.post("/classify", responses=schema(ClassificationResponse))
@with_cancellation
async def create_classify(body: ClassificationRequest, raw_request: Request) -> Response:
    state = await get_state(raw_request, body.model, "classify")
    outputs, request_id = await pool(state, body, "classify", "classify")
    data = []
    for i, out in enumerate(outputs):
        data.append(
            {
                "index": i,
                "label": out.outputs.label,
                "probs": out.outputs.probs,
                "num_classes": out.outputs.num_classes,
            }
        )
    return list_response(state, request_id, data, outputs, body.model)


@router.post("/score", responses=schema(ScoreResponse))
@router.post("/v1/score", responses=schema(ScoreResponse))
@with_cancellation
async def create_score(body: ScoreRequest, raw_request: Request) -> Response:
    state = await get_state(raw_request, body.model, SCORE_TASK)
    inputs_1, inputs_2 = body.inputs()
    scores, outputs, request_id, _ = await _score(state, body, inputs_1, inputs_2, "score")
    data = [
        {"index": i, "object": "score", "score": out.outputs.score} for i, out in enumerate(scores)
    ]
    return list_response(state, request_id, data, outputs, body.model)


@router.post(
    "/rerank",
    responses=shared_schema("RerankResponse", "TEIRerankResponse"),
    openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
        "schema": any_of("RerankRequest", "TEIRerankRequest")}}}},
)  # fmt: skip
async def rerank(raw_request: Request) -> Response:
    """Jina's body (``query`` + ``documents``) or text-embeddings-inference's (``query`` +
    ``texts``, answered and refused in TEI's shapes)."""
    body = await raw_request.json()
    if isinstance(body, dict) and "texts" in body and "documents" not in body:
        return await answer_tei(raw_request, TEIRerankRequest, tei_rerank)
    try:
        parsed = RerankRequest.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None
    response: Response = await create_rerank(parsed, raw_request=raw_request)
    return response


@router.post("/v1/rerank", responses=schema(RerankResponse))
@with_cancellation
async def create_rerank(body: RerankRequest, raw_request: Request) -> Response:
    """Jina's shape: ``{id, model, usage, results: [{index, relevance_score, document}]}``;
    ``usage.truncated_documents`` counts the documents cut to fit."""
    state = await get_state(raw_request, body.model, SCORE_TASK)
    results, num_tokens, num_cut, request_id = await _rerank(state, body, return_documents=True)
    usage = {
        "prompt_tokens": num_tokens,
        "total_tokens": num_tokens,
        "truncated_documents": num_cut,
    }
    return json_response(
        {
            "id": request_id,
            "model": state.echoed_model(body.model),
            "usage": usage,
            "results": results,
        }
    )


@router.post("/v2/rerank", responses=schema(RerankV2Response))
@with_cancellation
async def create_rerank_v2(body: RerankRequest, raw_request: Request) -> Response:
    """Cohere v2's shape: ``{id, results: [{index, relevance_score, document?}], meta}``;
    ``meta.warnings`` says when documents were cut to fit."""
    state = await get_state(raw_request, body.model, SCORE_TASK)
    results, num_tokens, num_cut, request_id = await _rerank(state, body, return_documents=False)
    meta: dict[str, Any] = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}
    if num_cut:
        meta["warnings"] = [f"{num_cut} document(s) were truncated to fit the model"]
    usage = {
        "prompt_tokens": num_tokens,
        "total_tokens": num_tokens,
        "truncated_documents": num_cut,
    }
    return json_response(
        {
            "id": request_id,
            "model": state.echoed_model(body.model),
            "results": results,
            "meta": meta,
            "usage": usage,
        }
    )


@with_cancellation
async def tei_rerank(body: TEIRerankRequest, raw_request: Request) -> Response:
    """TEI's rerank: every text by score, best first (ties in input order), ``[{index, score,
    text?}]``. ``truncate``: documents too long are cut to fit (the query is kept whole);
    without it a pair too long for the model is refused."""
    state = await get_state(raw_request, task=SCORE_TASK)
    if not body.texts:
        raise EmptyBatch("`texts` cannot be empty: send at least one text")
    check_query(body.query)
    capabilities = state.client.capabilities
    if capabilities is None or capabilities.score_type is None:
        raise WrongModelType(
            f"/rerank needs a re-ranker (cross-encoder) or an embedding model; "
            f"{state.model_name} serves {', '.join(state.supported_tasks) or 'no pooling task'}"
        )
    if capabilities.score_type == "cross_encoder" and capabilities.num_labels != 1:
        raise WrongModelType(
            f"/rerank needs a re-ranker (a classifier with 1 label); {state.model_name} has "
            f"{capabilities.num_labels} labels: use /predict"
        )
    truncate = body.truncate if body.truncate is not None else state.options.auto_truncate
    request = RerankRequest(
        query=body.query,
        documents=list(body.texts),
        use_activation=not body.raw_scores,
        truncation_side=body.truncation_side,
    )
    scores, _, _, _ = await _score(
        state, request, body.query, body.texts, "rerank", fit_documents=truncate
    )
    values = [s.outputs.score for s in scores]
    ranks = []
    for i in sorted(range(len(values)), key=lambda i: -values[i]):
        rank: dict[str, Any] = {"index": i, "score": values[i]}
        if body.return_text:
            rank["text"] = body.texts[i]
        ranks.append(rank)
    return json_response(ranks)


async def _rerank(
    state: ServerState, body: RerankRequest, return_documents: bool
) -> tuple[list[dict[str, Any]], int, int, str]:
    """Results by relevance (best first, ties in input order), the top ``top_n``; the number of
    prompt tokens run; the number of documents cut; the request id."""
    query, documents = body.inputs()
    scores, outputs, request_id, num_cut = await _score(
        state, body, query, documents, "rerank", fit_documents=True
    )
    chunks = [s.outputs.chunk_index for s in scores]
    results = body.results([s.outputs.score for s in scores], return_documents, chunks)
    return results, sum(len(out.prompt_token_ids) for out in outputs), num_cut, request_id


async def _score(
    state: ServerState,
    body: _ScoringBody,
    text_1: ScoreItem | Sequence[ScoreItem],
    text_2: ScoreItem | Sequence[ScoreItem],
    prefix: str,
    fit_documents: bool = False,
) -> tuple[list[PoolingRequestOutput[Any]], list[PoolingRequestOutput[Any]], str, int]:
    """Pair scores in pair order, the outputs of the requests run, the request id, and the
    number of documents cut. ``fit_documents`` (rerank): documents are cut to fit the model
    and to ``max_tokens_per_doc`` (default 4096, Cohere's: ``plan_scores``)."""
    # 1) validate, plan and tokenize, off the event loop  2) run in the core
    with timing.tokenization():
        plan, request_id = await state.offload(
            _prepare, state, body, text_1, text_2, prefix, fit_documents
        )
    timing.record_request_id(request_id)
    outputs = await state.run_pooling(plan.requests, "score")
    return plan.scores(outputs), outputs, request_id, plan.num_truncated_documents


def _prepare(
    state: ServerState,
    body: _ScoringBody,
    text_1: ScoreItem | Sequence[ScoreItem],
    text_2: ScoreItem | Sequence[ScoreItem],
    prefix: str,
    fit_documents: bool,
) -> tuple[ScorePlan, str]:
    """The score plan of ``body`` (its requests validated, tokenized) and the request id."""
    processor = state.processor()
    adapter = state.check_model(body.model)
    pairs = pair_score_inputs(text_1, text_2)
    names = ("text_1", "text_2") if prefix == "score" else ("query", "documents")
    state.check_texts([q for q, _ in pairs], names[0])
    state.check_texts([d for _, d in pairs], names[1])
    request_id = new_request_id(prefix, body.request_id)  # echoed to the client
    engine_id = new_request_id(prefix)  # the engine's key: never taken from the client
    plan = plan_scores(
        processor, engine_id, pairs, body.to_pooling_params(),
        max_tokens_per_doc=body.max_tokens_per_doc, instruction=body.instruction,
        fit_documents=fit_documents, priority=body.priority,
        chunk_overlap=body.window_overlap(),
        mode_weights=body.weights_for_different_modes, lora_request=adapter,
    )  # fmt: skip
    state.check_capacity(len(plan.requests))
    state.check_request_tokens(sum(len(r.prompt_token_ids) for r in plan.requests))
    return plan, request_id
