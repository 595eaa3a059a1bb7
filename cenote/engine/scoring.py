"""Scoring, shared by ``LLM.score`` and the server's /score and /rerank routes: pairing texts
(1 -> 1, 1 -> N, N -> N), reranker prompt templates, and the plan of pooling requests one score
call runs — a cross-encoder reads each pair; bi-encoders compare embeddings (cosine) and
late-interaction models token embeddings (MaxSim), in fp32. The plan's requests come from the
input processor; running them is the caller's (its engine client)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from cenote.engine.chat import render_template
from cenote.engine.input_processor import InputProcessor, ParentRequest, assign_adapter
from cenote.errors import InvalidInputError, UnsupportedTaskError
from cenote.inputs import ImagePrompt, PromptType
from cenote.lora.tasks import score_tasks
from cenote.lora_request import LoRARequest
from cenote.outputs import MultiTaskOutput, PoolingRequestOutput, ScoringOutput
from cenote.pooling_params import PoolingParams
from cenote.tasks import PoolingTask, PoolingTaskSelection

# Qwen3-Reranker's prompt (model card), served with classifier_from_token ["no", "yes"]
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {{ instruction }}\n<Query>: {{ query }}\n"
    "<Document>: {{ document }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{# the comment keeps the trailing newlines #}"
)
COHERE_MAX_TOKENS_PER_DOC = 4096  # rerank's default cut of each document (Cohere's)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

ScoreInput = str | Sequence[str]
T = TypeVar("T")
ScoreItem = str | ImagePrompt  # an image: embedding models with a vision tower (CLIP, SigLIP)


def pair_texts(text_1: ScoreInput, text_2: ScoreInput) -> list[tuple[str, str]]:
    """(query, document) pairs: 1 -> 1, 1 -> N (the query repeated) or N -> N (zipped)."""
    queries = [text_1] if isinstance(text_1, str) else list(text_1)
    documents = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, texts in (("text_1", queries), ("text_2", documents)):
        if not texts:
            raise InvalidInputError(f"score needs at least one text in {name}, got an empty list")
        bad = [i for i, t in enumerate(texts) if not isinstance(t, str)]
        if bad:
            raise InvalidInputError(
                f"{name}[{bad[0]}] is a {type(texts[bad[0]]).__name__}, not str"
            )
    return _pairs(queries, documents)


def pair_inputs(
    input_1: ScoreItem | Sequence[ScoreItem], input_2: ScoreItem | Sequence[ScoreItem]
) -> list[tuple[ScoreItem, ScoreItem]]:
    """``pair_texts`` where either side may also hold images (``{"image": ...}``)."""
    sides: list[list[ScoreItem]] = []
    for name, value in (("text_1", input_1), ("text_2", input_2)):
        items: list[ScoreItem] = [value] if isinstance(value, str | dict) else list(value)
        if not items:
            raise InvalidInputError(f"score needs at least one input in {name}, got an empty list")
        for i, item in enumerate(items):
            if not isinstance(item, str) and not (isinstance(item, dict) and "image" in item):
                raise InvalidInputError(
                    f"{name}[{i}] is a {type(item).__name__}, not str nor {{'image': ...}}"
                )
        sides.append(items)
    return _pairs(*sides)


def pair_score_inputs(
    input_1: ScoreItem | Sequence[ScoreItem], input_2: ScoreItem | Sequence[ScoreItem]
) -> list[tuple[ScoreItem, ScoreItem]]:
    """``pair_texts`` when both sides are texts (its messages name texts), else
    ``pair_inputs``."""
    sides = [[x] if isinstance(x, str | dict) else list(x) for x in (input_1, input_2)]
    if all(isinstance(item, str) for side in sides for item in side):
        return list(pair_texts(*(_texts(side) for side in sides)))
    return pair_inputs(input_1, input_2)


def _texts(items: list[ScoreItem]) -> list[str]:
    return [item for item in items if isinstance(item, str)]


def _pairs(queries: list[T], documents: list[T]) -> list[tuple[T, T]]:
    if len(queries) == 1:
        queries = queries * len(documents)
    elif len(queries) != len(documents):
        raise InvalidInputError(
            f"score pairs 1 query with N documents or N queries with N documents; got "
            f"{len(queries)} queries and {len(documents)} documents"
        )
    return list(zip(queries, documents, strict=True))


def score_template(hf_config: dict[str, Any]) -> str | None:
    """The model's query/document prompt template: ``score_template`` from the config (or
    hf_overrides), Qwen3-Reranker's for ``is_original_qwen3_reranker``, else None (pairs are
    tokenized as ``[CLS] query [SEP] document [SEP]``)."""
    template = hf_config.get("score_template")
    if template is None and hf_config.get("is_original_qwen3_reranker"):
        template = QWEN3_RERANKER_TEMPLATE
    return template


def render_pairs(
    template: str, pairs: list[tuple[str, str]], instruction: str | None = None
) -> list[str]:
    """One prompt per pair, rendered in the chat-template sandbox."""
    return [
        render_template(
            template, query=q, document=d, instruction=instruction or DEFAULT_INSTRUCTION
        )
        for q, d in pairs
    ]


def cosine_scores(queries: list[torch.Tensor], documents: list[torch.Tensor]) -> list[float]:
    """Cosine similarity of each (query, document) embedding pair, in fp32."""
    q = torch.stack([x.float() for x in queries])  # [num_pairs, dim]
    d = torch.stack([x.float() for x in documents])
    return F.cosine_similarity(q, d, dim=-1).tolist()


def dot_scores(queries: list[torch.Tensor], documents: list[torch.Tensor]) -> list[float]:
    """Dot product of each (query, document) pair: sparse (SPLADE) vocabulary weights, fp32."""
    q = torch.stack([x.float() for x in queries])  # [num_pairs, vocab_size]
    d = torch.stack([x.float() for x in documents])
    return (q * d).sum(dim=-1).tolist()


def maxsim_scores(queries: list[torch.Tensor], documents: list[torch.Tensor]) -> list[float]:
    """Late interaction (ColBERT): for each query token the best document token's dot product,
    summed over query tokens. Inputs: ``[num_tokens, dim]`` per text, fp32. All-zero document
    rows are tokens the model leaves out (ColBERT's punctuation) and never match."""
    scores = []
    for q, d in zip(queries, documents, strict=True):
        d = d.float()
        kept = d[d.abs().sum(dim=-1) > 0]  # [num_kept, dim]
        d = kept if len(kept) else d
        scores.append((q.float() @ d.T).max(dim=-1).values.sum().item())
    return scores


# BGE-M3's three outputs, read from one trunk pass per text, and the weights of their scores
# (dense, sparse, ColBERT) in its model card's ``compute_score`` example
M3_TASKS: tuple[PoolingTask, ...] = ("embed", "embed_sparse", "token_embed")
M3_CARD_WEIGHTS = (0.4, 0.2, 0.4)


def check_mode_weights(weights: Sequence[float]) -> tuple[float, float, float]:
    """``weights_for_different_modes``: three finite non-negative numbers, not all zero."""
    values = list(weights) if isinstance(weights, Sequence) else []
    if len(values) != 3 or not all(
        isinstance(w, int | float) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
        for w in values
    ):
        raise InvalidInputError(
            "weights_for_different_modes must be 3 finite non-negative numbers [dense, sparse, "
            f"colbert] (BGE-M3's card: {list(M3_CARD_WEIGHTS)}), got {weights!r:.100}",
            param="weights_for_different_modes",
        )
    if sum(values) <= 0:
        raise InvalidInputError(
            f"weights_for_different_modes {values} sum to 0; at least one must be positive",
            param="weights_for_different_modes",
        )
    return float(values[0]), float(values[1]), float(values[2])


def combined_mode_scores(
    queries: list[MultiTaskOutput],
    documents: list[MultiTaskOutput],
    weights: tuple[float, float, float],
) -> list[float]:
    """FlagEmbedding's ``BGEM3FlagModel.compute_score`` "colbert+sparse+dense" per pair, fp32:
    ``(w_dense * dense + w_sparse * sparse + w_colbert * colbert) / sum(weights)``, where dense
    is the dot product of the normalized CLS embeddings, sparse the lexical matching score (the
    sum over tokens in both texts of the product of their weights: the dot product of the
    vocabulary vectors, zero elsewhere) and colbert the mean over the query's vectors of their
    best dot product with the document's."""
    w_dense, w_sparse, w_colbert = weights
    dense = dot_scores([q["embed"].data for q in queries], [d["embed"].data for d in documents])
    sparse = dot_scores(
        [q["embed_sparse"].data for q in queries], [d["embed_sparse"].data for d in documents]
    )
    scores = []
    for q, d, dense_score, sparse_score in zip(queries, documents, dense, sparse, strict=True):
        q_vectors = q["token_embed"].data.float()  # [query tokens - 1, colbert_dim]
        d_vectors = d["token_embed"].data.float()  # [document tokens - 1, colbert_dim]
        colbert = (q_vectors @ d_vectors.T).max(dim=-1).values.mean().item()
        total = w_dense * dense_score + w_sparse * sparse_score + w_colbert * colbert
        scores.append(total / (w_dense + w_sparse + w_colbert))
    return scores


# ---- the plan of one score call ---------------------------------------------------------------


@dataclass
class ScorePlan:
    """The pooling requests one score call runs, and how their outputs become pair scores."""

    requests: list[ParentRequest]  # what to run, in order
    query_rows: list[int]  # per pair: the row of its query (or of the pair) in ``requests``
    document_rows: list[int] | None  # per pair: the row of its document; None: cross-encoder
    late_interaction: bool = False  # MaxSim over token embeddings instead of cosine
    sparse: bool = False  # dot product of sparse embeddings instead of cosine
    # BGE-M3: dense, sparse and ColBERT outputs of one pass per text, their scores combined
    # with these weights (FlagEmbedding's weights_for_different_modes) instead of cosine
    mode_weights: tuple[float, float, float] | None = None
    num_truncated_documents: int = 0  # documents cut (to fit, or to max_tokens_per_doc)
    # chunk-and-max (cross-encoders): per pair, the rows of its document's windows
    window_rows: list[list[int]] | None = None

    def scores(self, outputs: list[PoolingRequestOutput[Any]]) -> list[PoolingRequestOutput[Any]]:
        """One ``ScoringOutput`` per pair, in pair order, from the outputs of ``requests``."""
        if self.window_rows is not None:  # the best window's score, and which window it is
            results = []
            for rows in self.window_rows:
                values = [float(outputs[row].outputs.data[0]) for row in rows]
                best = max(range(len(values)), key=lambda w: values[w])  # first of equals
                ids = [t for row in rows for t in outputs[row].prompt_token_ids]
                score = ScoringOutput(score=values[best], chunk_index=best)
                results.append(PoolingRequestOutput(outputs[rows[0]].request_id, score, ids))
            return results
        if self.document_rows is None:  # cross-encoder: the activated logit of each pair
            return [
                PoolingRequestOutput(
                    request_id=outputs[row].request_id,
                    outputs=ScoringOutput(score=float(outputs[row].outputs.data[0])),
                    prompt_token_ids=outputs[row].prompt_token_ids,
                )
                for row in self.query_rows
            ]
        similarity = maxsim_scores if self.late_interaction else cosine_scores
        if self.sparse:
            similarity = dot_scores
        queries = [outputs[row] for row in self.query_rows]
        documents = [outputs[row] for row in self.document_rows]
        if self.mode_weights is not None:
            values = combined_mode_scores(
                [q.outputs for q in queries], [d.outputs for d in documents], self.mode_weights
            )
        else:
            values = similarity(
                [q.outputs.data for q in queries], [d.outputs.data for d in documents]
            )
        return [
            PoolingRequestOutput(
                request_id=d.request_id,
                outputs=ScoringOutput(score=value),
                prompt_token_ids=q.prompt_token_ids + d.prompt_token_ids,
            )
            for value, q, d in zip(values, queries, documents, strict=True)
        ]


def plan_scores(
    processor: InputProcessor,
    request_id: str,
    pairs: Sequence[tuple[ScoreItem, ScoreItem]],
    params: PoolingParams | None = None,
    *,
    max_tokens_per_doc: int | None = None,
    instruction: str | None = None,
    fit_documents: bool = False,
    priority: int = 0,
    chunk_overlap: int | None = None,
    mode_weights: Sequence[float] | None = None,
    lora_request: LoRARequest | None = None,
) -> ScorePlan:
    """The requests (ids ``{request_id}-{i}``) that score ``pairs`` on the processor's model.
    ``params``: the caller's options (``truncate_prompt_tokens`` and ``truncation_side`` cut
    whole prompts — for a cross-encoder pair, the document side; ``use_activation`` for
    cross-encoders; ``lora_task``: a per-task adapter for both sides, or "retrieval" for
    retrieval.query on queries and retrieval.passage on documents, ``lora.tasks.score_tasks``);
    the task is scoring's. ``max_tokens_per_doc`` cuts documents only (0: no
    cut; rerank's default: 4096, Cohere's). ``fit_documents`` (rerank, as Cohere and Jina):
    documents too long for the model are cut to fit, queries are kept whole. ``chunk_overlap``
    (cross-encoders; rerank_chunking "max"): a document is read in windows that overlap by this
    many tokens, the query whole in each, and scores as its best window. ``mode_weights``
    (models serving embed, embed_sparse and token_embed: BGE-M3): each text's three outputs
    from one pass, combined as FlagEmbedding's ``compute_score`` with
    ``weights_for_different_modes``. ``lora_request``: the adapter (a served model's) every
    request runs under; it cannot be combined with ``lora_task``. Errors name the query or
    document at fault by its index."""
    processor.check_task("score")
    if mode_weights is not None:
        weights = check_mode_weights(mode_weights)
        for task in M3_TASKS:
            if task not in processor.capabilities.supported_tasks:
                raise UnsupportedTaskError(
                    "weights_for_different_modes combines BGE-M3's dense, sparse and ColBERT "
                    f"scores; {processor.model_config.served_model_name} serves "
                    f"{', '.join(processor.capabilities.supported_tasks)}, not {task}"
                )
    params = params or PoolingParams()
    if max_tokens_per_doc is not None and (
        not isinstance(max_tokens_per_doc, int) or max_tokens_per_doc < 0
    ):
        raise InvalidInputError(
            "max_tokens_per_doc must be a non-negative integer (0: no cut), "
            f"got {max_tokens_per_doc!r}"
        )
    if max_tokens_per_doc == 0:  # vLLM: 0 cuts nothing
        max_tokens_per_doc = None
    elif max_tokens_per_doc is None and fit_documents:
        max_tokens_per_doc = COHERE_MAX_TOKENS_PER_DOC
    side_tasks: tuple[str | None, str | None] = (None, None)
    if params.lora_task is not None:
        side_tasks = score_tasks(processor.model_config, params.lora_task)
    plan = _Planner(
        processor, request_id, params, max_tokens_per_doc, fit_documents, priority, side_tasks,
        lora_request,
    )  # fmt: skip
    if processor.capabilities.score_type == "cross_encoder":
        text_pairs = _text_pairs(pairs)
        if chunk_overlap is not None:
            return plan.cross_encoder_windows(text_pairs, chunk_overlap)
        return plan.cross_encoder(text_pairs, instruction)
    if chunk_overlap is not None:
        raise InvalidInputError(
            "chunk-and-max reranking (rerank_chunking 'max') reads query-document pairs: it "
            f"applies to cross-encoders; {processor.model_config.served_model_name} scores by "
            f"{processor.capabilities.score_type}"
        )
    if mode_weights is not None:
        return dataclasses.replace(plan.embeddings(pairs, M3_TASKS), mode_weights=weights)
    return plan.embeddings(pairs)


def _text_pairs(pairs: Sequence[tuple[ScoreItem, ScoreItem]]) -> list[tuple[str, str]]:
    """A cross-encoder's pairs, all texts."""
    text_pairs = []
    for i, (query, document) in enumerate(pairs):
        if not isinstance(query, str) or not isinstance(document, str):
            raise InvalidInputError(
                f"pair {i} holds an image; a cross-encoder scores text pairs only"
            )
        text_pairs.append((query, document))
    return text_pairs


def _score_key(item: ScoreItem) -> object:
    """A query's identity among a call's pairs (an image: the object the caller passed)."""
    return item if isinstance(item, str) else ("image", id(item["image"]))


@dataclass
class _Planner:
    processor: InputProcessor
    request_id: str
    params: PoolingParams  # the caller's options
    max_tokens_per_doc: int | None
    fit_documents: bool
    priority: int
    side_tasks: tuple[str | None, str | None]  # the per-task adapters of queries, documents
    lora_request: LoRARequest | None  # the adapter every request runs under (None: the base)

    def _requests(
        self, prompts: Sequence[PromptType], params: PoolingParams, first: int, **options: Any
    ) -> list[ParentRequest]:
        """The requests of ``prompts``, tokenized once; the processor refuses a prompt too long
        for the model, named by ``options``' label and index ("document 3 has 302 tokens")."""
        ids = [f"{self.request_id}-{first + i}" for i in range(len(prompts))]
        return self.processor.process_batch(
            ids, prompts, params, priority=self.priority, lora_request=self.lora_request, **options
        )

    def _check_one_label(self) -> None:
        num_labels = self.processor.capabilities.num_labels
        if num_labels != 1:
            raise InvalidInputError(
                f"score needs a classifier with 1 label (a cross-encoder); "
                f"{self.processor.model_config.served_model_name} has {num_labels}: use classify"
            )

    def cross_encoder(self, pairs: list[tuple[str, str]], instruction: str | None) -> ScorePlan:
        """A one-label classifier reads each pair: ``[CLS] q [SEP] d [SEP]`` with segment
        ids, or the model's prompt template; the score is its activated logit."""
        processor = self.processor
        self._check_one_label()
        params = self.params.with_task("classify")
        template = score_template(processor.model_config.hf_config)
        if template is None:
            if self.fit_documents and params.truncate_prompt_tokens is None:
                params = dataclasses.replace(params, truncate_prompt_tokens=-1)
            prompts: list[PromptType] = [{"text": q, "text_pair": d} for q, d in pairs]
            requests = self._requests(
                prompts, params, 0, max_tokens_per_doc=self.max_tokens_per_doc, label="pair"
            )
            num_cut = sum(request.truncated for request in requests)
        else:
            num_cut = 0
            if self.max_tokens_per_doc is not None:
                documents = [d for _, d in pairs]
                cut = processor.truncate_texts(documents, self.max_tokens_per_doc)
                num_cut = sum(c is not d for c, d in zip(cut, documents, strict=True))
                pairs = [(q, d) for (q, _), d in zip(pairs, cut, strict=True)]
            rendered = render_pairs(template, pairs, instruction)
            requests = self._requests(rendered, params, 0, label="pair")
        rows = list(range(len(requests)))
        return ScorePlan(requests, rows, None, num_truncated_documents=num_cut)

    def cross_encoder_windows(self, pairs: list[tuple[str, str]], overlap: int) -> ScorePlan:
        """Chunk-and-max: every window of every document as a pair of its own."""
        processor = self.processor
        if score_template(processor.model_config.hf_config) is not None:
            raise InvalidInputError(
                "chunk-and-max reranking reads [CLS] query [SEP] window [SEP] pairs; "
                f"{processor.model_config.served_model_name} scores through a prompt template"
            )
        self._check_one_label()
        params = self.params.with_task("classify")
        windows = processor.process_pair_windows(
            self.request_id, pairs, params, overlap, priority=self.priority,
            max_tokens_per_doc=self.max_tokens_per_doc,
        )  # fmt: skip
        requests = [request for pair in windows for request in pair]
        assign_adapter(requests, self.lora_request)
        rows, first = [], 0
        for pair in windows:
            rows.append(list(range(first, first + len(pair))))
            first += len(pair)
        num_cut = sum(pair[-1].truncated for pair in windows)  # cut by max_tokens_per_doc
        return ScorePlan(
            requests, [r[0] for r in rows], None, num_truncated_documents=num_cut, window_rows=rows
        )

    def embeddings(
        self,
        pairs: Sequence[tuple[ScoreItem, ScoreItem]],
        multi_task: tuple[PoolingTask, ...] | None = None,
    ) -> ScorePlan:
        """Embed each distinct query once and every document, then compare per pair;
        ``multi_task``: every text gets these tasks' outputs from one pass instead."""
        processor = self.processor
        score_type = processor.capabilities.score_type
        tasks: dict[str, PoolingTask] = {
            "late_interaction": "token_embed",
            "sparse": "embed_sparse",
        }
        task: PoolingTaskSelection = tasks.get(score_type or "", "embed")
        if multi_task is not None:
            task, score_type = multi_task, None
        truncate = self.params.truncate_prompt_tokens
        doc_truncate = truncate
        if self.max_tokens_per_doc is not None:
            doc_truncate = min(self.max_tokens_per_doc, processor.model_config.max_model_len)
            if truncate not in (None, -1):
                doc_truncate = min(truncate, doc_truncate)
        if self.fit_documents and doc_truncate is None:
            doc_truncate = -1
        side = self.params.truncation_side
        query_task, document_task = self.side_tasks
        query_params = PoolingParams(
            task=task, truncate_prompt_tokens=truncate, truncation_side=side, lora_task=query_task
        )
        document_params = dataclasses.replace(
            query_params, truncate_prompt_tokens=doc_truncate, lora_task=document_task
        )
        # 1) distinct queries (1 -> N embeds the query once), named by their first pair
        first_pair: dict[object, int] = {}
        for j, (query, _) in enumerate(pairs):
            first_pair.setdefault(_score_key(query), j)
        queries = self._requests(
            [pairs[j][0] for j in first_pair.values()], query_params, 0, role="query",
            label="query", indices=list(first_pair.values()),
        )  # fmt: skip
        # 2) documents after them
        documents = self._requests(
            [d for _, d in pairs], document_params, len(queries), role="document",
            label="document",
        )  # fmt: skip
        query_rows = {query: row for row, query in enumerate(first_pair)}
        return ScorePlan(
            requests=queries + documents,
            query_rows=[query_rows[_score_key(q)] for q, _ in pairs],
            document_rows=[len(queries) + i for i in range(len(pairs))],
            late_interaction=score_type == "late_interaction",
            sparse=score_type == "sparse",
            num_truncated_documents=sum(document.truncated for document in documents),
        )
