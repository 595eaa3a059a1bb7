"""The pooler contract: what the runner hands a pooler, and what a pooler says it reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from cenote.pooling.metadata import PoolingMetadata
from cenote.tasks import PoolingTask


@dataclass(frozen=True)
class PoolingRequirements:
    """What a pooler reads of a prompt's hidden states for one task; the engine core and the
    runner ask, instead of looking at how the pooler pools."""

    last_token_only: bool  # only the prompt's last row (LAST pooling)

    @property
    def whole_prompt(self) -> bool:
        """Every row from the first: a chunked prompt's rows are kept until it completes."""
        return not self.last_token_only

    @property
    def prefix_cache_safe(self) -> bool:
        """Rows served from the prefix cache (never computed) are not needed."""
        return self.last_token_only


# what a model's pooler returns per request: the tensor of its task, or a task -> tensor map
# for a request asking several tasks of one trunk pass
PoolerResult = torch.Tensor | dict[str, torch.Tensor]

WHOLE_PROMPT = PoolingRequirements(last_token_only=False)
LAST_TOKEN = PoolingRequirements(last_token_only=True)


class Pooler(Protocol):
    """Hidden states of finished prompts -> one result per request, for the tasks it serves."""

    def get_supported_tasks(self) -> tuple[PoolingTask, ...]: ...

    def requirements(self, task: PoolingTask) -> PoolingRequirements:
        """What the pooler reads for ``task`` (one of ``get_supported_tasks()``)."""
        ...

    def __call__(self, hidden: torch.Tensor, metadata: PoolingMetadata) -> list[torch.Tensor]:
        """``hidden [num_tokens, hidden]``: each request's rows, in metadata order."""
        ...
