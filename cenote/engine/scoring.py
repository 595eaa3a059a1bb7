"""Scoring, shared by ``LLM.score`` and the server's /score and /rerank routes: pairing texts
(1 -> 1, 1 -> N, N -> N), reranker prompt templates, and the plan of pooling requests one score
call runs — a cross-encoder reads each pair; bi-encoders compare embeddings (cosine) and
late-interaction models token embeddings (MaxSim), in fp32. Running the plan is the caller's."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cenote.engine.chat import render_template
from cenote.engine.input_processor import InputProcessor, TokenizedPrompt
from cenote.errors import InvalidInputError, UnsupportedTaskError
from cenote.outputs import (
    ClassificationOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
)
from cenote.pooling_params import PoolingParams

# Qwen3-Reranker's prompt (model card), served with classifier_from_token ["no", "yes"]
QWEN3_RERANKER_TEMPLATE = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query "
    'and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {{ instruction }}\n<Query>: {{ query }}\n"
    "<Document>: {{ document }}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    "{# the comment keeps the trailing newlines #}"
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"

ScoreInput = str | Sequence[str]


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


# ---- the plan of one score call ---------------------------------------------------------------


@dataclass
class ScorePlan:
    """The pooling requests one score call runs, and how their outputs become pair scores."""

    prompts: list[TokenizedPrompt]  # what to run, in order
    params: list[PoolingParams]  # one per prompt
    output_class: type[PoolingOutput]  # what the engine returns per prompt
    query_rows: list[int]  # per pair: the row of its query (or of the pair) in ``prompts``
    document_rows: list[int] | None  # per pair: the row of its document; None: cross-encoder
    late_interaction: bool = False  # MaxSim over token embeddings instead of cosine
    sparse: bool = False  # dot product of sparse embeddings instead of cosine
    num_truncated_documents: int = 0  # documents cut (to fit, or to max_tokens_per_doc)

    def scores(self, outputs: list[PoolingRequestOutput]) -> list[PoolingRequestOutput]:
        """One ``ScoringOutput`` per pair, in pair order, from the outputs of ``prompts``."""
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
        values = similarity([q.outputs.data for q in queries], [d.outputs.data for d in documents])
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
    pairs: list[tuple[str, str]],
    truncate_prompt_tokens: int | None = None,
    max_tokens_per_doc: int | None = None,
    instruction: str | None = None,
    use_activation: bool | None = None,
    fit_documents: bool = False,
) -> ScorePlan:
    """Validate and tokenize the requests that score ``pairs`` on the processor's model.
    ``max_tokens_per_doc`` cuts documents only (0: no cut); ``truncate_prompt_tokens`` cuts whole prompts
    (for a cross-encoder pair, the document side). ``fit_documents`` (rerank, as Cohere and
    Jina): documents too long for the model are cut to fit, queries are kept whole. Errors name
    the query or document at fault by its index."""
    caps = processor.capabilities
    if caps.score_type is None:
        raise UnsupportedTaskError(
            f"task 'score' is not supported by {processor.model_config.served_model_name}; "
            f"it supports {', '.join(caps.supported_tasks)}"
        )
    if max_tokens_per_doc is not None and (
        not isinstance(max_tokens_per_doc, int) or max_tokens_per_doc < 0
    ):
        raise InvalidInputError(
            "max_tokens_per_doc must be a non-negative integer (0: no cut), "
            f"got {max_tokens_per_doc!r}"
        )
    if max_tokens_per_doc == 0:  # vLLM: 0 cuts nothing
        max_tokens_per_doc = None
    if caps.score_type == "cross_encoder":
        return _plan_cross_encoder(
            processor, pairs, truncate_prompt_tokens, max_tokens_per_doc, instruction,
            use_activation, fit_documents,
        )  # fmt: skip
    return _plan_embedding(
        processor, pairs, truncate_prompt_tokens, max_tokens_per_doc, fit_documents
    )


def _num_tokens(processor: InputProcessor, texts: list[str]) -> list[int]:
    """Tokens of each text, special tokens excluded."""
    return [len(e.ids) for e in processor.tokenizer.encode_batch(texts, add_special_tokens=False)]


def _limit(processor: InputProcessor, truncate_prompt_tokens: int | None) -> int:
    limit = processor.model_config.max_model_len
    return limit if truncate_prompt_tokens in (None, -1) else min(truncate_prompt_tokens, limit)


def _too_long(what: str, num_tokens: int, limit: int) -> InvalidInputError:
    return InvalidInputError(
        f"{what} has {num_tokens} tokens, but the model's limit (max_model_len) is {limit}; pass "
        f"truncate_prompt_tokens=-1 (or max_tokens_per_doc) to cut documents to fit"
    )


def _plan_cross_encoder(
    processor: InputProcessor,
    pairs: list[tuple[str, str]],
    truncate_prompt_tokens: int | None,
    max_tokens_per_doc: int | None,
    instruction: str | None,
    use_activation: bool | None,
    fit_documents: bool = False,
) -> ScorePlan:
    """A one-label classifier reads each pair: ``[CLS] q [SEP] d [SEP]`` with segment ids, or
    the model's prompt template; the score is its activated logit."""
    num_labels = processor.capabilities.num_labels
    if num_labels != 1:
        raise InvalidInputError(
            f"score needs a classifier with 1 label (a cross-encoder); "
            f"{processor.model_config.served_model_name} has {num_labels}: use classify"
        )
    params = PoolingParams(
        task="classify", truncate_prompt_tokens=truncate_prompt_tokens,
        use_activation=use_activation,
    )  # fmt: skip
    processor.check_pooling_params(params)
    template = score_template(processor.model_config.hf_config)
    num_cut = 0
    if template is None:
        if fit_documents and truncate_prompt_tokens is None:
            truncate_prompt_tokens = -1
        num_cut = _check_pairs(processor, pairs, truncate_prompt_tokens, max_tokens_per_doc)
        prompts = processor.tokenize_pairs(pairs, truncate_prompt_tokens, max_tokens_per_doc)
    else:
        if max_tokens_per_doc is not None:
            pairs = [(q, _cut_text(processor, d, max_tokens_per_doc)) for q, d in pairs]
        prompts = processor.tokenize(
            render_pairs(template, pairs, instruction), truncate_prompt_tokens
        )
    rows = list(range(len(prompts)))
    return ScorePlan(
        prompts, [params] * len(prompts), ClassificationOutput, rows, None,
        num_truncated_documents=num_cut,
    )  # fmt: skip


def _check_pairs(
    processor: InputProcessor,
    pairs: list[tuple[str, str]],
    truncate_prompt_tokens: int | None,
    max_tokens_per_doc: int | None,
) -> int:
    """Cross-encoder pairs: a pair too long without truncation names its document; returns the
    number of documents that will be cut."""
    limit = _limit(processor, truncate_prompt_tokens)
    num_special = processor.tokenizer.num_special_tokens_to_add(is_pair=True)
    query_lens = _num_tokens(processor, [q for q, _ in pairs])
    document_lens = _num_tokens(processor, [d for _, d in pairs])
    num_cut = 0
    for j, (query_len, document_len) in enumerate(zip(query_lens, document_lens, strict=True)):
        budget = (
            document_len if max_tokens_per_doc is None else min(document_len, max_tokens_per_doc)
        )
        total = query_len + budget + num_special
        if truncate_prompt_tokens is None and total > limit:
            raise _too_long(f"document {j} (with the query)", total, limit)
        num_cut += budget < document_len or total > limit
    return num_cut


def _cut_text(processor: InputProcessor, text: str, max_tokens: int) -> str:
    ids = processor.tokenizer.encode(text, add_special_tokens=False).ids
    return text if len(ids) <= max_tokens else processor.tokenizer.decode(ids[:max_tokens])


def _plan_embedding(
    processor: InputProcessor,
    pairs: list[tuple[str, str]],
    truncate_prompt_tokens: int | None,
    max_tokens_per_doc: int | None,
    fit_documents: bool = False,
) -> ScorePlan:
    """Embed each distinct query once and every document, then compare per pair."""
    late_interaction = processor.capabilities.score_type == "late_interaction"
    task = "token_embed" if late_interaction else "embed"
    sparse = processor.capabilities.score_type == "sparse"
    if sparse:
        task = "embed_sparse"
    doc_truncate = truncate_prompt_tokens
    if max_tokens_per_doc is not None:
        limit = processor.model_config.max_model_len
        doc_truncate = min(max_tokens_per_doc, limit)
        if truncate_prompt_tokens not in (None, -1):
            doc_truncate = min(truncate_prompt_tokens, doc_truncate)
    if fit_documents and doc_truncate is None:
        doc_truncate = -1
    num_cut = _check_texts(processor, pairs, truncate_prompt_tokens, doc_truncate)
    query_params = PoolingParams(task=task, truncate_prompt_tokens=truncate_prompt_tokens)
    document_params = PoolingParams(task=task, truncate_prompt_tokens=doc_truncate)
    processor.check_pooling_params(query_params)
    # 1) distinct queries (1 -> N embeds the query once)  2) documents after them
    query_index: dict[str, int] = {}
    for query, _ in pairs:
        query_index.setdefault(query, len(query_index))
    queries = processor.tokenize(
        list(query_index), truncate_prompt_tokens, role="query", label="query"
    )
    documents = processor.tokenize(
        [d for _, d in pairs], doc_truncate, role="document", label="document"
    )
    num_queries = len(queries)
    return ScorePlan(
        prompts=queries + documents,
        params=[query_params] * num_queries + [document_params] * len(documents),
        output_class=PoolingOutput,
        query_rows=[query_index[q] for q, _ in pairs],
        document_rows=[num_queries + i for i in range(len(pairs))],
        late_interaction=late_interaction,
        sparse=sparse,
        num_truncated_documents=num_cut,
    )


def _check_texts(
    processor: InputProcessor,
    pairs: list[tuple[str, str]],
    query_truncate: int | None,
    document_truncate: int | None,
) -> int:
    """Bi-encoder inputs: a text too long without truncation is named (``query 0``,
    ``document 3``); returns the number of documents that will be cut."""
    num_special = processor.tokenizer.num_special_tokens_to_add(is_pair=False)
    limit = processor.model_config.max_model_len
    if query_truncate is None:
        first_pair: dict[str, int] = {}
        for j, (query, _) in enumerate(pairs):
            first_pair.setdefault(query, j)
        for query, length in zip(first_pair, _num_tokens(processor, list(first_pair)), strict=True):
            if length + num_special > limit:
                raise _too_long(f"query {first_pair[query]}", length + num_special, limit)
    document_limit = _limit(processor, document_truncate)
    lengths = [n + num_special for n in _num_tokens(processor, [d for _, d in pairs])]
    if document_truncate is None:
        for j, length in enumerate(lengths):
            if length > limit:
                raise _too_long(f"document {j}", length, limit)
    return sum(length > document_limit for length in lengths)
