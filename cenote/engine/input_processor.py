"""Turn user prompts into validated, tokenized engine requests. All input errors are raised here."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Literal

from tokenizers import Tokenizer

from cenote.config import ModelConfig
from cenote.errors import InvalidInputError, InvalidInputTypeError, UnsupportedTaskError
from cenote.messages import EngineCoreRequest
from cenote.models.colbert import TextRole, colbert_prompts
from cenote.pooling_params import PoolingParams
from cenote.sampling_params import INT64_MAX, INT64_MIN, SamplingParams

# sparse: dot product of sparse (SPLADE) embeddings, as sentence-transformers' SparseEncoder
ScoreType = Literal["cross_encoder", "bi_encoder", "late_interaction", "sparse"]
PromptType = str | dict[str, Any]  # "text" | {"prompt": "text"} | {"prompt_token_ids": [...]}


@dataclass(frozen=True)
class ModelCapabilities:
    """What the loaded model can do, found at load time and passed to the edge."""

    supported_tasks: tuple[str, ...]  # e.g. ("embed", "token_embed")
    embedding_size: int | None  # output size of the embedding head (before matryoshka)
    is_matryoshka: bool  # dimensions may be requested
    eos_token_id: int | None  # ends generation
    num_labels: int | None = None  # columns of the classifier head (vocabulary for an LM head)
    label_names: tuple[str, ...] | None = None  # id2label, in label order
    score_type: ScoreType | None = None  # how score() compares texts
    uses_token_type_ids: bool = False  # segment ids matter (BERT pairs)


@dataclass
class TokenizedPrompt:
    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    token_type_ids: list[int] | None = None
    num_instruction_tokens: int = 0  # leading tokens of the prepended instruction prompt


class InputProcessor:
    """Validates at the edge, with errors that carry the numbers."""

    def __init__(
        self, model_config: ModelConfig, tokenizer: Tokenizer, capabilities: ModelCapabilities
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.capabilities = capabilities
        st = model_config.st_config
        self.do_lower_case = bool(st and st.do_lower_case)
        self.default_prompt = ""
        self.colbert = colbert_prompts(model_config, tokenizer)  # None: not ColBERT
        if st is not None and st.default_prompt_name:
            self.default_prompt = st.prompts.get(st.default_prompt_name, "")

    # ---- tokenization -----------------------------------------------------------------------

    def tokenize(
        self,
        prompts: Sequence[PromptType],
        truncate_prompt_tokens: int | None = None,
        truncation_side: str = "right",
        add_special_tokens: bool = True,
        is_pooling: bool = True,
        indices: Sequence[int] | None = None,
        role: TextRole = "document",
        label: str = "prompt",
    ) -> list[TokenizedPrompt]:
        """Tokenize a batch; texts go through the fast tokenizer in one call. ``indices`` are the
        prompts' positions in the user's list and ``label`` what the user calls them ("prompt",
        "query", "document"), for error messages. A ColBERT model formats pooled texts as a
        query or a document (``role``); other models ignore it."""
        indices = list(indices) if indices is not None else list(range(len(prompts)))
        max_length = self._truncation_length(truncate_prompt_tokens)
        texts: list[tuple[int, str]] = []
        results: list[TokenizedPrompt | None] = [None] * len(prompts)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                texts.append((i, prompt))
            elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                ids = self._check_token_ids(prompt["prompt_token_ids"], indices[i])
                if max_length is not None and len(ids) > max_length:
                    ids = ids[-max_length:] if truncation_side == "left" else ids[:max_length]
                results[i] = TokenizedPrompt(prompt.get("prompt"), ids)
            elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
                texts.append((i, prompt["prompt"]))
            else:
                raise InvalidInputTypeError(
                    f"prompt {indices[i]} is a {type(prompt).__name__}; expected a string or a dict with "
                    "'prompt' (text) or 'prompt_token_ids' (list of ints)"
                )
        if texts:
            colbert = self.colbert if is_pooling else None
            if colbert is not None:  # the marker after [CLS] takes one of the tokens
                limit = colbert.max_length(role) - 1
                max_length = limit if max_length is None else min(max_length - 1, limit)
            encoded = self._encode(
                [t for _, t in texts], max_length, truncation_side, add_special_tokens, is_pooling
            )
            for (i, text), enc in zip(texts, encoded, strict=True):
                ids = list(enc.ids) if colbert is None else colbert.format(list(enc.ids), role)
                results[i] = TokenizedPrompt(text, ids)
        if is_pooling and self.default_prompt:  # _encode prepended it to every text
            for i, _ in texts:
                results[i].num_instruction_tokens = self.instruction_length
        for i, result in enumerate(results):
            self._check_length(result.prompt_token_ids, indices[i], truncate_prompt_tokens, label)
        return results

    def _encode(self, texts: list[str], max_length, side, add_special_tokens, is_pooling):
        if is_pooling:
            texts = [self.default_prompt + t for t in texts]
            if self.do_lower_case:
                texts = [t.lower() for t in texts]
        if max_length is None:
            return self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        # Truncate as the tokenizer's own truncation does (the text is cut to leave room for the
        # special tokens), without toggling the shared tokenizer: safe from several threads.
        room = max_length
        if add_special_tokens:
            room = max(max_length - self.tokenizer.num_special_tokens_to_add(is_pair=False), 0)
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        for encoding in encoded:
            if len(encoding.ids) > room:
                encoding.truncate(room, direction=side)
        return [self.tokenizer.post_process(e, None, add_special_tokens) for e in encoded]

    @cached_property
    def instruction_length(self) -> int:
        """Tokens of the default instruction prompt as sentence-transformers counts them: the
        prompt tokenized alone, special tokens included, less a trailing special token."""
        prompt = self.default_prompt.lower() if self.do_lower_case else self.default_prompt
        encoding = self.tokenizer.encode(prompt)
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        length = len(encoding.ids)
        if length and (encoding.special_tokens_mask[-1] or encoding.ids[-1] in special):
            length -= 1
        return length

    def _truncation_length(self, truncate_prompt_tokens: int | None) -> int | None:
        limit = self.model_config.max_model_len
        if truncate_prompt_tokens is None:
            return None
        if truncate_prompt_tokens == -1:
            return limit
        if not isinstance(truncate_prompt_tokens, int) or not 1 <= truncate_prompt_tokens <= limit:
            raise InvalidInputError(
                f"truncate_prompt_tokens must be -1 (the model's limit) or between 1 and "
                f"{limit} (max_model_len), got {truncate_prompt_tokens}"
            )
        return truncate_prompt_tokens

    def _check_token_ids(self, ids: Any, index: int) -> list[int]:
        if not isinstance(ids, list | tuple) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidInputTypeError(f"prompt {index}: prompt_token_ids must be a list of ints")
        vocab = self.model_config.vocab_size
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < vocab:
                raise InvalidInputError(
                    f"prompt {index}: token id {token_id} at position {position} is outside the "
                    f"vocabulary (size {vocab})"
                )
        return list(ids)

    def _check_length(
        self, ids: list[int], index: int, truncate: int | None, label: str = "prompt"
    ) -> None:
        limit = self.model_config.max_model_len
        if not ids:
            raise InvalidInputError(f"{label} {index} is empty (0 tokens)")
        if len(ids) > limit:
            raise InvalidInputError(
                f"{label} {index} has {len(ids)} tokens, but the model's limit (max_model_len) is "
                f"{limit}; pass truncate_prompt_tokens=-1 (or a value up to {limit}) to truncate it"
            )

    # ---- requests ---------------------------------------------------------------------------

    def check_pooling_params(self, params: PoolingParams) -> None:
        caps = self.capabilities
        if params.task not in caps.supported_tasks:
            raise UnsupportedTaskError(
                f"task {params.task!r} is not supported by {self.model_config.served_model_name}; "
                f"it supports {', '.join(caps.supported_tasks)}"
            )
        if params.dimensions is not None:
            if params.task not in ("embed", "token_embed"):
                raise InvalidInputError(f"dimensions applies to embeddings, not to {params.task!r}")
            if not caps.is_matryoshka:
                raise InvalidInputError(
                    f"model {self.model_config.served_model_name} does not support matryoshka "
                    f"dimensions (its embedding size is {caps.embedding_size}); pass "
                    "hf_overrides={'is_matryoshka': True} if you know it does"
                )
            if not 1 <= params.dimensions <= (caps.embedding_size or 0):
                raise InvalidInputError(
                    f"dimensions must be between 1 and {caps.embedding_size} (the model's "
                    f"embedding size), got {params.dimensions}"
                )
            allowed = self.model_config.hf_config.get("matryoshka_dimensions")
            if allowed and params.dimensions not in allowed:
                raise InvalidInputError(
                    f"dimensions must be one of the model's matryoshka_dimensions {allowed}, "
                    f"got {params.dimensions}"
                )
        if params.max_active_dims is not None and params.task != "embed_sparse":
            raise InvalidInputError(
                f"max_active_dims applies to sparse embeddings (embed_sparse), not to "
                f"{params.task!r}"
            )
        self._check_token_task_params(params)

    def _check_token_task_params(self, params: PoolingParams) -> None:
        """step_tag_id / returned_token_ids: token_classify only, ids within range."""
        uses_step = params.step_tag_id is not None or params.returned_token_ids is not None
        if not uses_step:
            return
        if params.task != "token_classify":
            raise InvalidInputError(
                f"step_tag_id and returned_token_ids apply to 'token_classify' (reward), "
                f"not to {params.task!r}"
            )
        vocab = self.model_config.vocab_size
        if params.step_tag_id is not None and not 0 <= params.step_tag_id < vocab:
            raise InvalidInputError(
                f"step_tag_id {params.step_tag_id} is outside the vocabulary (size {vocab})"
            )
        num_columns = self.capabilities.num_labels or 0
        for column in params.returned_token_ids or []:
            if not isinstance(column, int) or not 0 <= column < num_columns:
                raise InvalidInputError(
                    f"returned_token_ids entry {column!r} is outside the classifier's "
                    f"{num_columns} columns"
                )

    def tokenize_pairs(
        self,
        pairs: Sequence[tuple[str, str]],
        truncate_prompt_tokens: int | None = None,
        max_tokens_per_doc: int | None = None,
    ) -> list[TokenizedPrompt]:
        """Cross-encoder inputs: ``[CLS] query [SEP] document [SEP]`` with segment ids. The
        document is cut first (``max_tokens_per_doc``, then to fit ``truncate_prompt_tokens``);
        a query that alone exceeds the limit is an error."""
        max_length = self._truncation_length(truncate_prompt_tokens)
        if max_tokens_per_doc is not None and (
            not isinstance(max_tokens_per_doc, int) or max_tokens_per_doc < 1
        ):
            raise InvalidInputError(
                f"max_tokens_per_doc must be a positive integer, got {max_tokens_per_doc!r}"
            )
        num_special = self.tokenizer.num_special_tokens_to_add(is_pair=True)
        queries = self.tokenizer.encode_batch([q for q, _ in pairs], add_special_tokens=False)
        documents = self.tokenizer.encode_batch([d for _, d in pairs], add_special_tokens=False)
        results = []
        for i, (query, document) in enumerate(zip(queries, documents, strict=True)):
            doc_budget = len(document.ids)
            if max_tokens_per_doc is not None:
                doc_budget = min(doc_budget, max_tokens_per_doc)
            if max_length is not None:
                room = max_length - num_special - len(query.ids)
                if room < 0:
                    raise InvalidInputError(
                        f"pair {i}: the query has {len(query.ids)} tokens (+{num_special} special), "
                        f"more than truncate_prompt_tokens={max_length}; documents are cut, "
                        "queries are not"
                    )
                doc_budget = min(doc_budget, room)
            if doc_budget < len(document.ids):
                document.truncate(doc_budget)
            pair = self.tokenizer.post_process(query, document, add_special_tokens=True)
            token_types = list(pair.type_ids) if self.capabilities.uses_token_type_ids else None
            results.append(TokenizedPrompt(None, list(pair.ids), token_types))
            self._check_length(results[-1].prompt_token_ids, i, truncate_prompt_tokens)
        return results

    def check_sampling_params(
        self, params: SamplingParams, num_prompt_tokens: int, index: int
    ) -> None:
        if "generate" not in self.capabilities.supported_tasks:
            raise UnsupportedTaskError(
                f"task 'generate' is not supported by {self.model_config.served_model_name}; "
                f"it supports {', '.join(self.capabilities.supported_tasks)}"
            )
        max_logprobs = min(self.model_config.max_logprobs, self.model_config.vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > max_logprobs:
                raise InvalidInputError(
                    f"{name}={value} is more than this server allows ({max_logprobs}, max_logprobs)"
                )
        vocab = self.model_config.vocab_size
        for field_name, ids in (
            ("logit_bias", list(params.logit_bias or {})),
            ("stop_token_ids", params.stop_token_ids or []),
        ):
            outside = [t for t in ids if not 0 <= t < vocab]
            if outside:
                raise InvalidInputError(
                    f"{field_name} has token ids outside the vocabulary (size {vocab}): "
                    f"{outside[:5]}"
                )
        limit = self.model_config.max_model_len
        if num_prompt_tokens + params.max_tokens > limit:
            raise InvalidInputError(
                f"prompt {index} has {num_prompt_tokens} tokens and asks for max_tokens="
                f"{params.max_tokens}, which exceeds the model's limit (max_model_len) of {limit}"
            )

    def make_request(
        self,
        request_id: str,
        prompt: TokenizedPrompt,
        sampling_params: SamplingParams | None = None,
        pooling_params: PoolingParams | None = None,
        priority: int = 0,
    ) -> EngineCoreRequest:
        if not INT64_MIN <= priority <= INT64_MAX:
            raise InvalidInputError(f"priority must be a 64-bit signed integer, got {priority}")
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt.prompt_token_ids,
            sampling_params=sampling_params,
            pooling_params=pooling_params
            if pooling_params is None or not prompt.num_instruction_tokens
            else dataclasses.replace(
                pooling_params, instruction_length=prompt.num_instruction_tokens
            ),
            token_type_ids=prompt.token_type_ids,
            eos_token_id=self.capabilities.eos_token_id,
            priority=priority,
        )
