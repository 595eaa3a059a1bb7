"""Request params against the loaded model: the task is served, the options fit it (the one
place that says "task X is not supported"). The input processor's first step."""

from __future__ import annotations

from cenote.config import ModelConfig
from cenote.engine.capabilities import ModelCapabilities
from cenote.errors import InvalidInputError, InvalidInputTypeError, UnsupportedTaskError
from cenote.pooling_params import TASK_OPTIONS, PoolingParams
from cenote.sampling_params import SamplingParams

Params = SamplingParams | PoolingParams


class ParamsValidator:
    def __init__(self, model_config: ModelConfig, capabilities: ModelCapabilities) -> None:
        self.model_config = model_config
        self.capabilities = capabilities

    def check_task(self, task: str) -> None:
        """The one place that says a task is not supported (``score``: any way to score)."""
        supported = self.capabilities.supported_tasks
        if task != "score" and task in supported:
            return
        if task == "score" and self.capabilities.score_type is not None:
            return
        raise UnsupportedTaskError(
            f"task {task!r} is not supported by {self.model_config.served_model_name}; "
            f"it supports {', '.join(supported)}"
        )

    def check(self, params: Params) -> None:
        """The params serve a task this model has, with options that fit it."""
        if isinstance(params, PoolingParams):
            self._check_pooling(params)
        elif isinstance(params, SamplingParams):
            self._check_sampling(params)
        else:
            raise InvalidInputTypeError(
                f"params must be SamplingParams or PoolingParams, got {type(params).__name__}"
            )
        self.truncation_length(params.truncate_prompt_tokens)

    def _check_pooling(self, params: PoolingParams) -> None:
        if params.task is None:
            raise InvalidInputError("pooling params need a task (embed, classify, ...)")
        if isinstance(params.task, tuple):
            self._check_multi_task(params)
            return
        self._check_single_task(params)

    def _check_multi_task(self, params: PoolingParams) -> None:
        """Several tasks from one trunk pass: each served, each option applying to one of them,
        and no window joining (its windows would each run every task)."""
        tasks = params.tasks
        for task in tasks:
            self.check_task(task)
        if params.long_input == "chunk":
            raise InvalidInputError(
                "long_input 'chunk' joins the windows of a long text into one embedding; a "
                f"request for several tasks {list(tasks)} reads each text whole",
                param="long_input",
            )
        for option, applies_to in TASK_OPTIONS.items():
            if getattr(params, option) is not None and not set(applies_to) & set(tasks):
                raise InvalidInputError(
                    f"{option} applies to {' / '.join(applies_to)}, none of the tasks "
                    f"{list(tasks)}",
                    param=option,
                )
        for task in tasks:
            self._check_single_task(params.for_task(task))

    def _check_single_task(self, params: PoolingParams) -> None:
        caps = self.capabilities
        assert isinstance(params.task, str), "one task here (multi-task requests are split)"
        self.check_task(params.task)
        if params.dimensions is not None:
            if params.task not in ("embed", "token_embed"):
                raise InvalidInputError(f"dimensions applies to embeddings, not to {params.task!r}")
            if params.dimensions == caps.embedding_size:
                pass  # the full size cuts nothing: accepted on any model (clients send it always)
            elif not caps.is_matryoshka:
                raise InvalidInputError(
                    f"model {self.model_config.served_model_name} does not support matryoshka "
                    f"dimensions (its embedding size is {caps.embedding_size}); pass "
                    "hf_overrides={'is_matryoshka': True} if you know it does"
                )
            elif not 1 <= params.dimensions <= (caps.embedding_size or 0):
                raise InvalidInputError(
                    f"dimensions must be between 1 and {caps.embedding_size} (the model's "
                    f"embedding size), got {params.dimensions}"
                )
            elif (allowed := self.model_config.hf_config.get("matryoshka_dimensions")) and (
                params.dimensions not in allowed
            ):
                raise InvalidInputError(
                    f"dimensions must be one of the model's matryoshka_dimensions {allowed}, "
                    f"got {params.dimensions}"
                )
        if params.long_input == "chunk" and (
            params.task != "embed" or caps.chunkable_pooling is None
        ):
            raise InvalidInputError(
                "long_input 'chunk' joins the windows of a long text into one embedding: it "
                "applies to the embed task of a model that pools with CLS, MEAN or LAST, not to "
                f"{params.task!r} on model {self.model_config.served_model_name}"
            )
        if params.max_active_dims is not None and params.task != "embed_sparse":
            raise InvalidInputError(
                f"max_active_dims applies to sparse embeddings (embed_sparse), not to "
                f"{params.task!r}"
            )
        self._check_token_task(params)

    def _check_token_task(self, params: PoolingParams) -> None:
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

    def _check_sampling(self, params: SamplingParams) -> None:
        self.check_task("generate")
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

    def truncation_length(self, truncate_prompt_tokens: int | None) -> int | None:
        """The tokens a prompt is cut to (None: not cut), from ``truncate_prompt_tokens``."""
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
