"""``LoRARequest``: the adapter a request runs under, spelled as vLLM spells it."""

from __future__ import annotations

from dataclasses import dataclass

# ids from 1 name adapter folders; task i of a checkpoint's own task adapters (Jina v3) is
# adapter id TASK_ADAPTER_ID_BASE + i, far above any folder's
TASK_ADAPTER_ID_BASE = 1 << 40


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter folder, named and numbered by the caller (``lora_int_id`` >= 1 is its
    identity in the engine: the resident copy, the prefix-cache and embedding-cache keys)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("LoRARequest.lora_name must not be empty")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int):
            raise ValueError(f"LoRARequest.lora_int_id must be an int, got {self.lora_int_id!r}")
        if self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be >= 1, got {self.lora_int_id}")
