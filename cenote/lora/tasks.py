"""Per-task LoRA adapters built into a checkpoint (Jina v3, ``XLMRobertaLoRA``): a request's
``lora_task`` ("retrieval.query", ...) picks one.

Each task is an ordinary LoRA adapter of the base, so requests of different tasks share a step
(the base matmul once, each task's rank-r update on its own rows, ``models/layers/lora.py``).
The model writes every task's blocks into its layers when it loads (they are part of its
checkpoint and small: rank 4 on jina-embeddings-v3, 0.3% of its weights each), so they are
always resident: the ``LoRAManager`` never reads, evicts or counts them against
``--max-loras``. Their ids start at ``TASK_ADAPTER_ID_BASE``, far above the ids given to
adapter folders (``--lora-modules`` and runtime loads count from 1).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cenote.errors import InvalidInputError
from cenote.lora_request import TASK_ADAPTER_ID_BASE, LoRARequest

if TYPE_CHECKING:
    from cenote.config import ModelConfig

TASK_ADAPTER_ARCHITECTURES = ("XLMRobertaLoRA",)
# scoring's name for asymmetric retrieval: queries under the first adapter, documents the second
RETRIEVAL_TASK = "retrieval"
RETRIEVAL_SIDES = ("retrieval.query", "retrieval.passage")


def task_adapter_names(architecture: str, hf_config: dict[str, Any]) -> tuple[str, ...]:
    """The checkpoint's task names in adapter order (config.json ``lora_adaptations``); empty
    for a model without per-task adapters."""
    if architecture not in TASK_ADAPTER_ARCHITECTURES:
        return ()
    names = hf_config.get("lora_adaptations") or ()
    return tuple(str(name) for name in names)


def task_instruction(model_config: ModelConfig, task: str) -> str:
    """The text put before each input of ``task`` (config.json ``task_instructions``, as the
    remote code's ``encode(task=...)`` and sentence-transformers' ``prompt_name=task`` put it);
    empty when the task has none."""
    instructions = model_config.hf_config.get("task_instructions") or {}
    return str(instructions.get(task) or "")


def task_lora_request(model_config: ModelConfig, task: str) -> LoRARequest:
    """The adapter of ``task``; ``InvalidInputError`` (400) naming the tasks the model has, or
    saying it has none."""
    names = task_adapter_names(model_config.architecture, model_config.hf_config)
    model = model_config.served_model_name
    if not names:
        raise InvalidInputError(
            f"task {task!r} selects a per-task LoRA adapter, and {model} "
            f"({model_config.architecture}) has none; per-task adapters come with "
            f"{', '.join(TASK_ADAPTER_ARCHITECTURES)} checkpoints (jina-embeddings-v3)",
            param="task",
        )
    if task not in names:
        raise InvalidInputError(
            f"task {task!r} is not one of {model}'s adapters; it has {', '.join(names)}",
            param="task",
        )
    index = names.index(task)
    return LoRARequest(task, TASK_ADAPTER_ID_BASE + index, f"{model_config.path}#task={task}")


def score_tasks(model_config: ModelConfig, task: str) -> tuple[str, str]:
    """The adapters a score or rerank call with ``task`` runs its queries and its documents
    under. An adapter name applies to both sides (``text-matching``: symmetric similarity, as
    the model card says). ``"retrieval"`` is asymmetric retrieval as jina-embeddings-v3's card
    prescribes it: ``retrieval.query`` (and its instruction) for the queries,
    ``retrieval.passage`` for the documents; a query compared to passages embedded under the
    same query adapter is not what the model was trained for. Anything else is a 400 naming
    the model's tasks (or saying it has none)."""
    names = task_adapter_names(model_config.architecture, model_config.hf_config)
    if task == RETRIEVAL_TASK and task not in names and set(RETRIEVAL_SIDES) <= set(names):
        return RETRIEVAL_SIDES
    if names and task not in names:
        raise InvalidInputError(
            f"task {task!r} is not one of {model_config.served_model_name}'s adapters; it has "
            f"{', '.join(names)}, and scoring also takes {RETRIEVAL_TASK!r} "
            f"({RETRIEVAL_SIDES[0]} for queries, {RETRIEVAL_SIDES[1]} for documents)",
            param="task",
        )
    task_lora_request(model_config, task)  # a model without task adapters: says it has none
    return task, task


def is_task_adapter(lora_int_id: int) -> bool:
    """Whether ``lora_int_id`` names a checkpoint's built-in task adapter."""
    return lora_int_id >= TASK_ADAPTER_ID_BASE
