"""The pieces of ``LLM.score``: pairing texts, reranker prompt templates, and the two
embedding similarities (cosine for bi-encoders, MaxSim for late interaction), all in fp32."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from cenote.engine.chat import render_template
from cenote.errors import InvalidInputError
from cenote.outputs import ClassificationOutput, PoolingRequestOutput, ScoringOutput

if TYPE_CHECKING:
    from cenote.entrypoints.llm import LLM

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


def maxsim_scores(queries: list[torch.Tensor], documents: list[torch.Tensor]) -> list[float]:
    """Late interaction (ColBERT): for each query token the best document token's dot product,
    summed over query tokens. Inputs: ``[num_tokens, dim]`` per text, fp32."""
    return [
        (q.float() @ d.float().T).max(dim=-1).values.sum().item()
        for q, d in zip(queries, documents, strict=True)
    ]


# ---- orchestration (called by LLM.score) ----------------------------------------------------


def cross_encoder_scores(
    llm: LLM,
    pairs: list[tuple[str, str]],
    truncate_prompt_tokens: int | None,
    max_tokens_per_doc: int | None,
    instruction: str | None,
    use_tqdm: bool,
) -> list[PoolingRequestOutput[ScoringOutput]]:
    """A one-label classifier reads each pair: ``[CLS] q [SEP] d [SEP]`` with segment ids, or
    the model's prompt template; the score is its activated logit."""
    num_labels = llm.engine.capabilities.num_labels
    if num_labels != 1:
        raise InvalidInputError(
            f"score needs a classifier with 1 label (a cross-encoder); "
            f"{llm.config.model.served_model_name} has {num_labels}: use classify()"
        )
    # 1) params, validated  2) tokens  3) run  4) one score per pair
    template = score_template(llm.config.model.hf_config)
    params = llm._pooling_params(None, len(pairs), "classify", truncate_prompt_tokens)
    if template is None:
        tokenized = llm.input_processor.tokenize_pairs(
            pairs, truncate_prompt_tokens, max_tokens_per_doc
        )
    else:
        if max_tokens_per_doc is not None:
            pairs = [(q, _cut_text(llm, d, max_tokens_per_doc)) for q, d in pairs]
        tokenized = llm._tokenize_pooling(render_pairs(template, pairs, instruction), params)
    outputs = llm._submit_pooling(tokenized, params, ClassificationOutput, use_tqdm)
    return [
        PoolingRequestOutput(
            request_id=out.request_id,
            outputs=ScoringOutput(score=float(out.outputs.data[0])),
            prompt_token_ids=out.prompt_token_ids,
        )
        for out in outputs
    ]


def _cut_text(llm: LLM, text: str, max_tokens: int) -> str:
    ids = llm.tokenizer.encode(text, add_special_tokens=False).ids
    return text if len(ids) <= max_tokens else llm.tokenizer.decode(ids[:max_tokens])


def embedding_scores(
    llm: LLM,
    pairs: list[tuple[str, str]],
    late_interaction: bool,
    truncate_prompt_tokens: int | None,
    max_tokens_per_doc: int | None,
    use_tqdm: bool,
) -> list[PoolingRequestOutput[ScoringOutput]]:
    """Embed both sides, then cosine (bi-encoder) or MaxSim over token embeddings."""
    task = "token_embed" if late_interaction else "embed"
    doc_truncate = truncate_prompt_tokens
    if max_tokens_per_doc is not None:
        limited = truncate_prompt_tokens not in (None, -1)
        doc_truncate = (
            min(truncate_prompt_tokens, max_tokens_per_doc) if limited else max_tokens_per_doc
        )
    queries = llm.encode(
        [q for q, _ in pairs],
        pooling_task=task,
        truncate_prompt_tokens=truncate_prompt_tokens,
        use_tqdm=use_tqdm,
    )
    documents = llm.encode(
        [d for _, d in pairs],
        pooling_task=task,
        truncate_prompt_tokens=doc_truncate,
        use_tqdm=use_tqdm,
    )
    similarity = maxsim_scores if late_interaction else cosine_scores
    values = similarity([q.outputs.data for q in queries], [d.outputs.data for d in documents])
    return [
        PoolingRequestOutput(
            request_id=q.request_id,
            outputs=ScoringOutput(score=value),
            prompt_token_ids=q.prompt_token_ids + d.prompt_token_ids,
        )
        for value, q, d in zip(values, queries, documents, strict=True)
    ]
