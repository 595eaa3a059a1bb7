"""Pooler = method + head, per task, written as named pipelines:

- embeddings: pool -> project -> truncate -> normalize
- classification: pool -> score -> (select columns) -> activate
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from cenote.pooling.activation import Activation, activate
from cenote.pooling.heads import EmbeddingHead
from cenote.pooling.interface import (
    LAST_TOKEN,
    WHOLE_PROMPT,
    Pooler,
    PoolerResult,
    PoolingRequirements,
)
from cenote.pooling.metadata import PoolingMetadata, ScoreFn
from cenote.pooling.methods import (
    SEQUENCE_METHODS,
    PoolingMethod,
    pool_after_instructions,
    pool_all,
    pool_step,
)
from cenote.pooling_params import PoolingParams
from cenote.tasks import PoolingTask


def _sequence_requirements(method: PoolingMethod | None) -> PoolingRequirements:
    return LAST_TOKEN if method == "last" else WHOLE_PROMPT


class EmbeddingPooler(nn.Module):
    """Serves ``embed`` (one vector per prompt) and ``token_embed`` (one vector per token)."""

    def __init__(
        self,
        method: PoolingMethod,
        head: EmbeddingHead,
        output_size: int,
        include_prompt: bool = True,
    ) -> None:
        super().__init__()
        if method not in SEQUENCE_METHODS:
            raise ValueError(
                f"embedding pooling must be one of {sorted(SEQUENCE_METHODS)}, got {method!r}"
            )
        self.method = method
        self.head = head
        self.output_size = output_size  # embedding size before matryoshka truncation
        # False: CLS / MEAN leave out each request's instruction prompt (sentence-transformers)
        self.include_prompt = include_prompt

    @property
    def chunkable_method(self) -> Literal["cls", "mean", "last"] | None:
        """The method, when windows of one text pooled apart can be joined (chunking)."""
        method = self.method
        return method if method in ("cls", "mean", "last") else None

    def _pool(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
        skip = not self.include_prompt and self.method in ("cls", "mean")
        if skip and any(p.instruction_length for p in metadata.pooling_params):
            return pool_after_instructions(self.method, hidden, metadata)
        return SEQUENCE_METHODS[self.method](hidden, metadata)  # [num_requests, hidden]

    def get_supported_tasks(self) -> tuple[PoolingTask, ...]:
        return ("embed", "token_embed")

    def requirements(self, task: PoolingTask) -> PoolingRequirements:
        return _sequence_requirements(self.method) if task == "embed" else WHOLE_PROMPT

    def forward(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        """``hidden``: [num_tokens, hidden] rows of the pooled prompts -> one tensor per request."""
        tasks = [params.task for params in metadata.pooling_params]
        outputs: list[torch.Tensor | None] = [None] * metadata.num_requests
        if "embed" in tasks:
            pooled = self._pool(hidden, metadata)  # [num_requests, hidden]
            projected = self.head.project(pooled)
            # requests asking for the same cut and normalization: one call for all their rows
            # (8,192 short texts: 0.10 s a pass in per-request normalize calls)
            alike: dict[tuple[int | None, bool | None], list[int]] = {}
            for i, params in enumerate(metadata.pooling_params):
                if params.task == "embed":
                    alike.setdefault((params.dimensions, params.normalize), []).append(i)
            for (dimensions, normalize), indices in alike.items():
                rows = projected if len(indices) == len(tasks) else projected[indices]
                x = self.head.normalize(self.head.truncate(rows, dimensions), normalize)
                for i, row in zip(indices, x.unbind(0), strict=True):
                    outputs[i] = row
        if "token_embed" in tasks:
            for i, rows in enumerate(pool_all(hidden, metadata)):
                params = metadata.pooling_params[i]
                if params.task == "token_embed":
                    outputs[i] = self.head(rows, params)  # [prompt_len, dimensions]
        return _served(metadata, outputs)


class ClassifierPooler(nn.Module):
    """Serves ``classify`` (pool one row per prompt -> score -> activate) and ``token_classify``
    (every row, or the STEP rows where token == step_tag_id -> score -> returned_token_ids
    columns -> activate). ``score`` is the model's head; activation is per request;
    ``step_tag_id`` is the model's default for requests that pass none."""

    def __init__(
        self,
        method: PoolingMethod | None,  # sequence method for classify; None: token tasks only
        score: ScoreFn,
        activation: Activation,
        num_labels: int,
        step_tag_id: int | None = None,
    ) -> None:
        super().__init__()
        if method is not None and method not in SEQUENCE_METHODS:
            raise ValueError(
                f"classifier pooling must be one of {sorted(SEQUENCE_METHODS)}, got {method!r}"
            )
        self.method = method
        self.score = score
        self.activation = activation
        self.num_labels = num_labels
        self.step_tag_id = step_tag_id

    def get_supported_tasks(self) -> tuple[PoolingTask, ...]:
        return ("classify", "token_classify") if self.method is not None else ("token_classify",)

    def requirements(self, task: PoolingTask) -> PoolingRequirements:
        return _sequence_requirements(self.method) if task == "classify" else WHOLE_PROMPT

    def _activate(self, scores: torch.Tensor, use_activation: bool | None) -> torch.Tensor:
        return scores if use_activation is False else activate(scores, self.activation)

    def forward(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        tasks = [params.task for params in metadata.pooling_params]
        outputs: list[torch.Tensor | None] = [None] * metadata.num_requests
        if "classify" in tasks and self.method is not None:
            # 1) pool  2) score  3) activate
            pooled = SEQUENCE_METHODS[self.method](hidden, metadata)  # [num_requests, hidden]
            scores = self._score_requests(pooled, metadata)  # [num_requests, num_labels]
            for i, params in enumerate(metadata.pooling_params):
                if params.task == "classify":
                    outputs[i] = self._activate(scores[i], params.use_activation)
        if "token_classify" in tasks:
            # 1) pool (all rows or STEP rows)  2) score  3) select columns  4) activate
            for i, rows in enumerate(pool_step(hidden, metadata, self.step_tag_id)):
                params = metadata.pooling_params[i]
                if params.task != "token_classify":
                    continue
                scores = self._head(metadata, i)(rows)  # [num_rows, num_labels]
                if params.returned_token_ids is not None:
                    scores = scores[:, params.returned_token_ids]
                outputs[i] = self._activate(scores, params.use_activation)
        return _served(metadata, outputs)

    def _head(self, metadata: PoolingMetadata, i: int) -> ScoreFn:
        """Request ``i``'s head: its own (an adapter's ``modules_to_save``) or the model's."""
        heads = metadata.head_scores
        own = None if heads is None else heads[i]
        return self.score if own is None else own

    def _score_requests(self, pooled: torch.Tensor, metadata: PoolingMetadata) -> torch.Tensor:
        """``pooled [num_requests, hidden]`` -> ``[num_requests, num_labels]``, each request's
        row through its own head; the model's head once for all when no request brings one."""
        if metadata.head_scores is None:
            return self.score(pooled)
        groups: dict[int, list[int]] = {}  # id(head) -> request indices
        heads: dict[int, ScoreFn] = {}
        for i in range(metadata.num_requests):
            head = self._head(metadata, i)
            groups.setdefault(id(head), []).append(i)
            heads[id(head)] = head
        scores = torch.empty(pooled.shape[0], self.num_labels, device=pooled.device)
        for key, indices in groups.items():
            index = torch.tensor(indices, device=pooled.device)
            scores[index] = heads[key](pooled[index]).float()
        return scores


class DispatchPooler(nn.Module):
    """One pooler per task; each request is routed to the pooler of its task."""

    def __init__(self, poolers: dict[PoolingTask, Pooler]) -> None:
        super().__init__()
        self.poolers = poolers
        # registered as submodules, so ``.to(device)`` moves the heads (e.g. Dense) with it
        self.pooler_modules = nn.ModuleDict(
            {task: pooler for task, pooler in poolers.items() if isinstance(pooler, nn.Module)}
        )

    def get_supported_tasks(self) -> tuple[PoolingTask, ...]:
        return tuple(self.poolers)

    def requirements(self, task: PoolingTask) -> PoolingRequirements:
        return self.poolers[task].requirements(task)

    @property
    def embedding_size(self) -> int | None:
        """Size of ``embed`` / ``token_embed`` vectors before matryoshka truncation (None: the
        model does not embed)."""
        pooler = self.poolers.get("embed") or self.poolers.get("token_embed")
        return pooler.output_size if isinstance(pooler, EmbeddingPooler) else None

    @property
    def embedding_pooler(self) -> EmbeddingPooler | None:
        """The pooler of ``embed`` when it pools a sequence into one vector (None: no embed task,
        or another kind: ColBERT, sparse)."""
        pooler = self.poolers.get("embed")
        return pooler if isinstance(pooler, EmbeddingPooler) else None

    @property
    def num_labels(self) -> int | None:
        """Columns of ``classify`` / ``token_classify`` scores (None: the model does not
        classify)."""
        pooler = self.poolers.get("classify") or self.poolers.get("token_classify")
        return pooler.num_labels if isinstance(pooler, ClassifierPooler) else None

    def forward(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[PoolerResult]:
        """One result per request: its task's tensor, or for a multi-task request a task ->
        tensor map, every task pooled from the same rows (the trunk ran once for them all)."""
        # 0) the usual step: single-task requests that one pooler serves, handed over whole
        asked = {params.task for params in metadata.pooling_params}
        assert None not in asked, "the API that received the request sets its task"
        single_tasks = [task for task in asked if isinstance(task, str)]
        if len(single_tasks) == len(asked):
            poolers = {id(self.poolers[task]): self.poolers[task] for task in single_tasks}
            if len(poolers) == 1:
                return list(next(iter(poolers.values()))(hidden, metadata))
        # 1) one job per (request, task): the pooler of the task, the task's own params
        jobs: dict[int, list[tuple[int, PoolingParams]]] = {}  # id(pooler) -> jobs
        by_id: dict[int, Pooler] = {}
        for i, params in enumerate(metadata.pooling_params):
            for task in params.tasks:
                pooler = self.poolers[task]
                single = params.for_task(task) if params.is_multi_task else params
                jobs.setdefault(id(pooler), []).append((i, single))
                by_id[id(pooler)] = pooler
        # 2) each pooler on its jobs' rows (a request's rows once per task it asks of it)
        results: list[dict[str, torch.Tensor]] = [{} for _ in range(metadata.num_requests)]
        loc = metadata.start_loc
        for key, entries in jobs.items():
            rows = torch.cat([hidden[loc[i] : loc[i + 1]] for i, _ in entries])
            start_loc = [0]
            for i, _ in entries:
                start_loc.append(start_loc[-1] + loc[i + 1] - loc[i])
            sub = PoolingMetadata(
                start_loc=start_loc,
                pooling_params=[params for _, params in entries],
                prompt_token_ids=[metadata.prompt_token_ids[i] for i, _ in entries],
                head_scores=None
                if metadata.head_scores is None
                else [metadata.head_scores[i] for i, _ in entries],
            )
            for (i, params), result in zip(entries, by_id[key](rows, sub), strict=True):
                assert isinstance(params.task, str)
                results[i][params.task] = result
        # 3) a multi-task request's map in the order it asked; a single task's one tensor
        return [
            {task: found[task] for task in params.tasks}
            if params.is_multi_task
            else found[str(params.task)]
            for found, params in zip(results, metadata.pooling_params, strict=True)
        ]


def _served(metadata: PoolingMetadata, outputs: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """``outputs`` once every request has one."""
    missing = [
        p.task for p, out in zip(metadata.pooling_params, outputs, strict=True) if out is None
    ]
    assert not missing, f"tasks {missing} reached a pooler that cannot serve them"
    return [out for out in outputs if out is not None]
