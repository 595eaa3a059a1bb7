"""POST /classify, /score + /v1/score (vLLM shapes), /rerank + /v1/rerank (Jina shape) and
/v2/rerank (Cohere shape). Scoring is planned by ``cenote.engine.scoring``, as in ``LLM.score``:
cross-encoders read pairs, bi-encoders compare embeddings (cosine), late interaction MaxSim."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from cenote.engine.scoring import ScorePlan, pair_texts, plan_scores
from cenote.messages import EngineCoreRequest
from cenote.outputs import ClassificationOutput, PoolingRequestOutput
from cenote.server.body import JSONRoute
from cenote.server.errors import BadRequest
from cenote.server.protocol import ClassificationRequest, RerankRequest, ScoreRequest, _ScoringBody
from cenote.server.responses import (
    ClassificationResponse,
    RerankResponse,
    RerankV2Response,
    ScoreResponse,
    schema,
)
from cenote.server.routes_pooling import json_response, list_response, pool
from cenote.server.state import ServerState, get_state, new_request_id, with_cancellation

router = APIRouter(route_class=JSONRoute)

COHERE_MAX_TOKENS_PER_DOC = 4096  # Cohere's default cut of each document
_SCORE_FIELDS = (
    ("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2")
)  # fmt: skip


@router.post("/classify", responses=schema(ClassificationResponse))
@with_cancellation
async def create_classify(body: ClassificationRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    outputs, request_id = await pool(state, body, "classify", "classify", ClassificationOutput)
    label_names = state.client.capabilities.label_names
    data = []
    for i, out in enumerate(outputs):
        out.outputs.label_names = label_names
        data.append(
            {
                "index": i,
                "label": out.outputs.label,
                "probs": out.outputs.probs,
                "num_classes": out.outputs.num_classes,
            }
        )
    return list_response(state, request_id, data, outputs)


@router.post("/score", responses=schema(ScoreResponse))
@router.post("/v1/score", responses=schema(ScoreResponse))
@with_cancellation
async def create_score(body: ScoreRequest, raw_request: Request) -> Response:
    state = get_state(raw_request)
    sent = {name for names in _SCORE_FIELDS for name in names if getattr(body, name) is not None}
    given = [names for names in _SCORE_FIELDS if sent.issuperset(names)]
    if len(given) != 1 or sent != set(given[0]):
        raise BadRequest(
            "pass one pair of fields: queries and documents (or queries and items, data_1 and "
            "data_2, text_1 and text_2)",
            param="queries",
        )
    text_1, text_2 = (getattr(body, n) for n in given[0])
    scores, outputs, request_id, _ = await _score(state, body, text_1, text_2, "score")
    data = [
        {"index": i, "object": "score", "score": out.outputs.score} for i, out in enumerate(scores)
    ]
    return list_response(state, request_id, data, outputs)


@router.post("/rerank", responses=schema(RerankResponse))
@router.post("/v1/rerank", responses=schema(RerankResponse))
@with_cancellation
async def create_rerank(body: RerankRequest, raw_request: Request) -> Response:
    """Jina's shape: ``{id, model, usage, results: [{index, relevance_score, document}]}``;
    ``usage.truncated_documents`` counts the documents cut to fit."""
    state = get_state(raw_request)
    results, num_tokens, num_cut, request_id = await _rerank(state, body, return_documents=True)
    usage = {
        "prompt_tokens": num_tokens,
        "total_tokens": num_tokens,
        "truncated_documents": num_cut,
    }
    return json_response(
        {"id": request_id, "model": state.model_name, "usage": usage, "results": results}
    )


@router.post("/v2/rerank", responses=schema(RerankV2Response))
@with_cancellation
async def create_rerank_v2(body: RerankRequest, raw_request: Request) -> Response:
    """Cohere v2's shape: ``{id, results: [{index, relevance_score, document?}], meta}``;
    ``meta.warnings`` says when documents were cut to fit."""
    state = get_state(raw_request)
    results, num_tokens, num_cut, request_id = await _rerank(state, body, return_documents=False)
    meta: dict = {"api_version": {"version": "2"}, "billed_units": {"search_units": 1}}
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
            "model": state.model_name,
            "results": results,
            "meta": meta,
            "usage": usage,
        }
    )


async def _rerank(
    state: ServerState, body: RerankRequest, return_documents: bool
) -> tuple[list[dict], int, int, str]:
    """Results by relevance (best first, ties in input order), the top ``top_n``; the number of
    prompt tokens run; the number of documents cut; the request id."""
    texts = body.document_texts
    if not texts:
        raise BadRequest("rerank needs at least one document, got 0", param="documents")
    if body.top_n is not None and body.top_n < 0:
        raise BadRequest(f"top_n must be 0 (all) or positive, got {body.top_n}", param="top_n")
    scores, outputs, request_id, num_cut = await _score(
        state, body, body.query, texts, "rerank", fit_documents=True
    )
    order = sorted(range(len(texts)), key=lambda i: -scores[i].outputs.score)
    if body.top_n:
        order = order[: body.top_n]
    if body.return_documents is not None:
        return_documents = body.return_documents
    results = []
    for i in order:
        result: dict = {"index": i, "relevance_score": scores[i].outputs.score}
        if return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return results, sum(len(out.prompt_token_ids) for out in outputs), num_cut, request_id


async def _score(
    state: ServerState,
    body: _ScoringBody,
    text_1: str | list[str],
    text_2: str | list[str],
    prefix: str,
    fit_documents: bool = False,
) -> tuple[list[PoolingRequestOutput], list[PoolingRequestOutput], str, int]:
    """Pair scores in pair order, the outputs of the requests run, the request id, and the
    number of documents cut. ``fit_documents`` (rerank): documents are cut to fit the model
    and to ``max_tokens_per_doc`` (default 4096, Cohere's)."""
    # 1) validate, plan and tokenize, off the event loop  2) run in the core
    plan, requests, request_id = await state.offload(
        _prepare, state, body, text_1, text_2, prefix, fit_documents
    )
    prompts = [p.prompt for p in plan.prompts]
    outputs = await state.run_pooling(requests, prompts, plan.output_class)
    return plan.scores(outputs), outputs, request_id, plan.num_truncated_documents


def _prepare(
    state: ServerState,
    body: _ScoringBody,
    text_1: str | list[str],
    text_2: str | list[str],
    prefix: str,
    fit_documents: bool,
) -> tuple[ScorePlan, list[EngineCoreRequest], str]:
    """The score plan of ``body``, its engine requests (validated, tokenized), the request id."""
    processor = state.processor()
    state.check_model(body.model)
    pairs = pair_texts(text_1, text_2)
    names = ("text_1", "text_2") if prefix == "score" else ("query", "documents")
    state.check_texts([q for q, _ in pairs], names[0])
    state.check_texts([d for _, d in pairs], names[1])
    max_tokens_per_doc = body.max_tokens_per_doc
    if fit_documents and max_tokens_per_doc is None:
        max_tokens_per_doc = COHERE_MAX_TOKENS_PER_DOC
    plan = plan_scores(
        processor, pairs, body.truncate_prompt_tokens, max_tokens_per_doc,
        body.instruction, body.use_activation, fit_documents,
    )  # fmt: skip
    state.check_capacity(len(plan.prompts))
    request_id = new_request_id(prefix, body.request_id)  # echoed to the client
    engine_id = new_request_id(prefix)  # the engine's key: never taken from the client
    requests = [
        processor.make_request(
            f"{engine_id}-{i}", prompt, pooling_params=params, priority=body.priority
        )
        for i, (prompt, params) in enumerate(zip(plan.prompts, plan.params, strict=True))
    ]
    state.check_request_tokens(sum(len(p.prompt_token_ids) for p in plan.prompts))
    return plan, requests, request_id
