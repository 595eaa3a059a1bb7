"""Architecture name -> (module, class), imported lazily. No name guessing."""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from cenote.errors import UnknownArchitectureError
from cenote.tasks import SupportedTask


@dataclass(frozen=True)
class ModelEntry:
    """Where an architecture lives and what it can do."""

    module: str  # module under cenote.models
    class_name: str  # trunk class in that module
    is_causal: bool  # decoder with KV cache, or bidirectional encoder
    tasks: tuple[SupportedTask, ...]  # tasks served without conversion


_ENCODER_TASKS: tuple[SupportedTask, ...] = ("embed", "token_embed")
_DECODER_TASKS: tuple[SupportedTask, ...] = ("generate", "embed", "token_embed")

_REGISTRY: dict[str, ModelEntry] = {
    "BertModel": ModelEntry("bert", "BertModel", False, _ENCODER_TASKS),
    "RobertaModel": ModelEntry("bert", "RobertaModel", False, _ENCODER_TASKS),
    "XLMRobertaModel": ModelEntry("bert", "RobertaModel", False, _ENCODER_TASKS),
    "LlamaForCausalLM": ModelEntry("llama", "LlamaForCausalLM", True, _DECODER_TASKS),
    "MistralForCausalLM": ModelEntry("llama", "LlamaForCausalLM", True, _DECODER_TASKS),
    "Qwen2ForCausalLM": ModelEntry("llama", "Qwen2ForCausalLM", True, _DECODER_TASKS),
    "Qwen3ForCausalLM": ModelEntry("llama", "Qwen3ForCausalLM", True, _DECODER_TASKS),
    "LlamaForSequenceClassification": ModelEntry(
        "llama", "LlamaForSequenceClassification", True, ("classify",)
    ),
    "MistralForSequenceClassification": ModelEntry(
        "llama", "LlamaForSequenceClassification", True, ("classify",)
    ),
    "Qwen2ForSequenceClassification": ModelEntry(
        "llama", "Qwen2ForSequenceClassification", True, ("classify",)
    ),
    "Qwen3ForSequenceClassification": ModelEntry(
        "llama", "Qwen3ForSequenceClassification", True, ("classify",)
    ),
}


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_entry(architecture: str) -> ModelEntry:
    if architecture not in _REGISTRY:
        raise UnknownArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    return _REGISTRY[architecture]


def load_model_class(architecture: str) -> type:
    entry = get_entry(architecture)
    module = importlib.import_module(f"cenote.models.{entry.module}")
    return getattr(module, entry.class_name)
