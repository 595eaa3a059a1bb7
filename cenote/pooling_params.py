"""Per-request pooling options, vLLM-compatible."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cenote.errors import InvalidInputError
from cenote.tasks import POOLING_TASKS, PoolingTask, PoolingTaskSelection

# the options that apply to some tasks only: a multi-task request hands each task the ones
# that apply to it (``for_task``)
TASK_OPTIONS: dict[str, tuple[PoolingTask, ...]] = {
    "dimensions": ("embed", "token_embed"),
    "max_active_dims": ("embed_sparse",),
    "step_tag_id": ("token_classify",),
    "returned_token_ids": ("token_classify",),
}


@dataclass
class PoolingParams:
    """Options of one pooling request. ``task`` is filled in by the API that receives it."""

    # embed | token_embed | classify | token_classify | embed_sparse, or several of them as a
    # tuple: every one from the same trunk pass, results by task (a multi-task request)
    task: PoolingTaskSelection | None = None
    dimensions: int | None = None  # matryoshka truncation of embeddings
    normalize: bool | None = None  # L2-normalize embeddings; None = the model's default
    use_activation: bool | None = None  # classifier activation; None = the model's default
    truncate_prompt_tokens: int | None = None  # keep this many tokens (-1 = the model's limit)
    truncation_side: Literal["left", "right"] = "right"  # which end truncation cuts
    step_tag_id: int | None = None  # process reward: rows where token == step_tag_id
    returned_token_ids: list[int] | None = None  # process reward: columns to return
    max_active_dims: int | None = None  # embed_sparse: keep the k largest weights (top-k)
    # the instruction prompt put before each text (sentence-transformers' encode(prompt_name=,
    # prompt=)): a key of the model's prompts, or the literal text; neither: the model's default
    prompt_name: str | None = None
    prompt: str | None = None
    # a text longer than max_model_len: refused ("error"), or embedded in windows joined into
    # one embedding ("chunk", cenote.engine.chunking) with chunk_overlap tokens shared
    long_input: Literal["error", "chunk"] = "error"
    chunk_overlap: int = 0
    # Jina v3: the checkpoint's per-task LoRA adapter to run under ("retrieval.query", ...; the
    # ``task`` of its encode() and of Jina's API); its instruction is the default prompt
    lora_task: str | None = None
    # leading tokens that are the model's instruction prompt (set by the input processor);
    # a sentence-transformers Pooling with include_prompt=false leaves them out
    instruction_length: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.task, list):  # a JSON list or a caller's list: one tuple form
            self.task = tuple(self.task)
        if isinstance(self.task, tuple):
            _check_task_tuple(self.task)
        elif self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidInputError(
                f"unknown pooling task {self.task!r}; choose one of {POOLING_TASKS}"
            )
        if self.dimensions is not None and (
            not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise InvalidInputError(
                f"dimensions must be a positive integer, got {self.dimensions!r}"
            )
        if self.max_active_dims is not None and (
            not isinstance(self.max_active_dims, int)
            or isinstance(self.max_active_dims, bool)
            or self.max_active_dims < 1
        ):
            raise InvalidInputError(
                f"max_active_dims must be a positive integer, got {self.max_active_dims!r}"
            )
        for name in ("prompt_name", "prompt", "lora_task"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidInputError(f"{name} must be a string, got {type(value).__name__}")
        if self.prompt_name is not None and self.prompt is not None:
            raise InvalidInputError(
                f"pass prompt_name ({self.prompt_name!r}) or prompt (literal text), not both"
            )
        if self.long_input not in ("error", "chunk"):
            raise InvalidInputError(
                f"long_input must be 'error' or 'chunk', got {self.long_input!r}"
            )
        if (
            not isinstance(self.chunk_overlap, int)
            or isinstance(self.chunk_overlap, bool)
            or self.chunk_overlap < 0
        ):
            raise InvalidInputError(
                f"chunk_overlap must be a non-negative integer, got {self.chunk_overlap!r}"
            )
        if self.truncation_side not in ("left", "right"):
            raise InvalidInputError(
                f"truncation_side must be 'left' or 'right', got {self.truncation_side!r}"
            )

    def with_task(self, task: PoolingTaskSelection) -> PoolingParams:
        """A copy bound to ``task`` (an explicit task that differs is an error)."""
        if isinstance(task, list):
            task = tuple(task)
        if self.task is not None and self.task != task:
            raise InvalidInputError(f"pooling params are for task {self.task!r}, not {task!r}")
        return PoolingParams(**{**self.__dict__, "task": task})

    @property
    def is_multi_task(self) -> bool:
        """Several tasks from one trunk pass (``task`` is a tuple)."""
        return isinstance(self.task, tuple)

    @property
    def tasks(self) -> tuple[PoolingTask, ...]:
        """The task(s) asked, as a tuple (empty before the API binds one)."""
        if self.task is None:
            return ()
        return self.task if isinstance(self.task, tuple) else (self.task,)

    def for_task(self, task: PoolingTask) -> PoolingParams:
        """The single-task params of one task of a multi-task request: the options that apply
        to ``task`` kept, those of its other tasks dropped (``dimensions`` cuts the dense and
        token embeddings, ``max_active_dims`` the sparse one)."""
        assert task in self.tasks, f"{task!r} is not one of {self.tasks}"
        changes: dict[str, object] = {"task": task}
        for option, applies_to in TASK_OPTIONS.items():
            if task not in applies_to:
                changes[option] = None
        return PoolingParams(**{**self.__dict__, **changes})


def _check_task_tuple(tasks: tuple[object, ...]) -> None:
    """A multi-task selection: at least one known task, each once."""
    if not tasks:
        raise InvalidInputError(
            f"task is an empty list; name one or more of {POOLING_TASKS}", param="task"
        )
    unknown = [t for t in tasks if t not in POOLING_TASKS]
    if unknown:
        raise InvalidInputError(
            f"unknown pooling task {unknown[0]!r} in {list(tasks)}; choose from {POOLING_TASKS}",
            param="task",
        )
    repeated = sorted({str(t) for t in tasks if tasks.count(t) > 1})
    if repeated:
        raise InvalidInputError(
            f"task lists {', '.join(repeated)} more than once in {list(tasks)}; name each "
            "task once",
            param="task",
        )
