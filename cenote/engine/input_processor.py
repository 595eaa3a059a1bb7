"""Turn user prompts into validated, tokenized engine requests. All input errors are raised here."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from cenote.config import ModelConfig
from cenote.engine.messages import EngineCoreRequest
from cenote.errors import InvalidInputError, UnsupportedTaskError
from cenote.pooling_params import PoolingParams
from cenote.sampling_params import SamplingParams

PromptType = str | dict[str, Any]  # "text" | {"prompt": "text"} | {"prompt_token_ids": [...]}


@dataclass(frozen=True)
class ModelCapabilities:
    """What the loaded model can do, found at load time and passed to the edge."""

    supported_tasks: tuple[str, ...]  # e.g. ("embed", "token_embed")
    embedding_size: int | None  # output size of the embedding head (before matryoshka)
    is_matryoshka: bool  # dimensions may be requested
    eos_token_id: int | None  # ends generation


@dataclass
class TokenizedPrompt:
    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    token_type_ids: list[int] | None = None


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
    ) -> list[TokenizedPrompt]:
        """Tokenize a batch; texts go through the fast tokenizer in one call."""
        max_length = self._truncation_length(truncate_prompt_tokens)
        texts: list[tuple[int, str]] = []
        results: list[TokenizedPrompt | None] = [None] * len(prompts)
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, str):
                texts.append((i, prompt))
            elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                ids = self._check_token_ids(prompt["prompt_token_ids"], i)
                if max_length is not None and len(ids) > max_length:
                    ids = ids[-max_length:] if truncation_side == "left" else ids[:max_length]
                results[i] = TokenizedPrompt(prompt.get("prompt"), ids)
            elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
                texts.append((i, prompt["prompt"]))
            else:
                raise TypeError(
                    f"prompt {i} is a {type(prompt).__name__}; expected a string or a dict with "
                    "'prompt' (text) or 'prompt_token_ids' (list of ints)"
                )
        if texts:
            encoded = self._encode(
                [t for _, t in texts], max_length, truncation_side, add_special_tokens, is_pooling
            )
            for (i, text), enc in zip(texts, encoded, strict=True):
                results[i] = TokenizedPrompt(text, list(enc.ids))
        for i, result in enumerate(results):
            self._check_length(result.prompt_token_ids, i, truncate_prompt_tokens)
        return results

    def _encode(self, texts: list[str], max_length, side, add_special_tokens, is_pooling):
        if is_pooling:
            texts = [self.default_prompt + t for t in texts]
            if self.do_lower_case:
                texts = [t.lower() for t in texts]
        if max_length is not None:
            self.tokenizer.enable_truncation(max_length, direction=side)
        try:
            return self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        finally:
            self.tokenizer.no_truncation()

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
            raise TypeError(f"prompt {index}: prompt_token_ids must be a list of ints")
        vocab = self.model_config.vocab_size
        for position, token_id in enumerate(ids):
            if not 0 <= token_id < vocab:
                raise InvalidInputError(
                    f"prompt {index}: token id {token_id} at position {position} is outside the "
                    f"vocabulary (size {vocab})"
                )
        return list(ids)

    def _check_length(self, ids: list[int], index: int, truncate: int | None) -> None:
        limit = self.model_config.max_model_len
        if not ids:
            raise InvalidInputError(f"prompt {index} is empty (0 tokens)")
        if len(ids) > limit:
            raise InvalidInputError(
                f"prompt {index} has {len(ids)} tokens, but the model's limit (max_model_len) is "
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

    def check_sampling_params(
        self, params: SamplingParams, num_prompt_tokens: int, index: int
    ) -> None:
        if "generate" not in self.capabilities.supported_tasks:
            raise UnsupportedTaskError(
                f"task 'generate' is not supported by {self.model_config.served_model_name}; "
                f"it supports {', '.join(self.capabilities.supported_tasks)}"
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
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt.prompt_token_ids,
            sampling_params=sampling_params,
            pooling_params=pooling_params,
            token_type_ids=prompt.token_type_ids,
            eos_token_id=self.capabilities.eos_token_id,
            priority=priority,
        )
