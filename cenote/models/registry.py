"""Architecture name -> (module, class), imported lazily. No name guessing."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from cenote.errors import UnknownArchitectureError
from cenote.tasks import SupportedTask

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class ModelEntry:
    """Where an architecture lives and what it can do."""

    module: str  # module under cenote.models
    class_name: str  # trunk class in that module
    is_causal: bool  # decoder with KV cache, or bidirectional encoder
    tasks: tuple[SupportedTask, ...]  # tasks served without conversion


_ENCODER_TASKS: tuple[SupportedTask, ...] = ("embed", "token_embed")
# causal LMs also serve token_classify over their LM-head logits (process reward, STEP pooling)
_DECODER_TASKS: tuple[SupportedTask, ...] = ("generate", "embed", "token_embed", "token_classify")
_SEQ_CLS_TASKS: tuple[SupportedTask, ...] = ("classify", "token_classify")

_REGISTRY: dict[str, ModelEntry] = {
    "BertModel": ModelEntry("bert", "BertModel", False, _ENCODER_TASKS),
    "RobertaModel": ModelEntry("bert", "RobertaModel", False, _ENCODER_TASKS),
    "XLMRobertaModel": ModelEntry("bert", "RobertaModel", False, _ENCODER_TASKS),
    "BertForSequenceClassification": ModelEntry(
        "bert_classifiers", "BertForSequenceClassification", False, ("classify",)
    ),
    "RobertaForSequenceClassification": ModelEntry(
        "bert_classifiers", "RobertaForSequenceClassification", False, ("classify",)
    ),
    "XLMRobertaForSequenceClassification": ModelEntry(
        "bert_classifiers", "RobertaForSequenceClassification", False, ("classify",)
    ),
    "BertForTokenClassification": ModelEntry(
        "bert_classifiers", "BertForTokenClassification", False, ("token_classify",)
    ),
    "MPNetModel": ModelEntry("mpnet", "MPNetModel", False, _ENCODER_TASKS),
    "MPNetForSequenceClassification": ModelEntry(
        "mpnet", "MPNetForSequenceClassification", False, ("classify",)
    ),
    "DistilBertModel": ModelEntry("distilbert", "DistilBertModel", False, _ENCODER_TASKS),
    "DistilBertForSequenceClassification": ModelEntry(
        "distilbert", "DistilBertForSequenceClassification", False, ("classify",)
    ),
    # masked LMs serve sparse (SPLADE) embeddings over their vocabulary logits
    "BertForMaskedLM": ModelEntry("masked_lm", "BertForMaskedLM", False, ("embed_sparse",)),
    "DistilBertForMaskedLM": ModelEntry(
        "distilbert", "DistilBertForMaskedLM", False, ("embed_sparse",)
    ),
    "ModernBertModel": ModelEntry("modernbert", "ModernBertModel", False, _ENCODER_TASKS),
    "ModernBertForSequenceClassification": ModelEntry(
        "modernbert", "ModernBertForSequenceClassification", False, ("classify",)
    ),
    "NomicBertModel": ModelEntry("nomic_bert", "NomicBertModel", False, _ENCODER_TASKS),
    "T5EncoderModel": ModelEntry("t5_encoder", "T5EncoderModel", False, _ENCODER_TASKS),
    "MT5EncoderModel": ModelEntry("t5_encoder", "T5EncoderModel", False, _ENCODER_TASKS),
    # colbert-ai checkpoints: BERT + linear, token vectors for late interaction (MaxSim)
    "HF_ColBERT": ModelEntry("colbert", "HFColBERT", False, ("token_embed",)),
    "LlamaForCausalLM": ModelEntry("llama", "LlamaForCausalLM", True, _DECODER_TASKS),
    "Gemma3ForCausalLM": ModelEntry("gemma3", "Gemma3ForCausalLM", True, _DECODER_TASKS),
    # EmbeddingGemma: the Gemma 3 trunk as a (bidirectional) encoder
    "Gemma3TextModel": ModelEntry("gemma3", "Gemma3TextModel", False, _ENCODER_TASKS),
    "MistralForCausalLM": ModelEntry("llama", "LlamaForCausalLM", True, _DECODER_TASKS),
    "Qwen2ForCausalLM": ModelEntry("llama", "Qwen2ForCausalLM", True, _DECODER_TASKS),
    "Qwen3ForCausalLM": ModelEntry("llama", "Qwen3ForCausalLM", True, _DECODER_TASKS),
    "LlamaForSequenceClassification": ModelEntry(
        "llama", "LlamaForSequenceClassification", True, _SEQ_CLS_TASKS
    ),
    "MistralForSequenceClassification": ModelEntry(
        "llama", "LlamaForSequenceClassification", True, _SEQ_CLS_TASKS
    ),
    "Qwen2ForSequenceClassification": ModelEntry(
        "llama", "Qwen2ForSequenceClassification", True, _SEQ_CLS_TASKS
    ),
    "Qwen3ForSequenceClassification": ModelEntry(
        "llama", "Qwen3ForSequenceClassification", True, _SEQ_CLS_TASKS
    ),
    # reward per token (ALL) or per prompt (last token)
    "Qwen2ForRewardModel": ModelEntry(
        "qwen2_reward", "Qwen2ForRewardModel", True, ("classify", "token_classify")
    ),
    # process reward at the step tags (STEP)
    "Qwen2ForProcessRewardModel": ModelEntry(
        "qwen2_reward", "Qwen2ForProcessRewardModel", True, ("token_classify",)
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


ConvertOption = Literal["auto", "embed", "classify"]


def convert_architecture(architecture: str, convert: ConvertOption) -> str:
    """The architecture that serves ``convert``: a causal LM becomes its sequence-classification
    sibling for ``classify`` (pair it with ``classifier_from_token`` to build the head from
    LM-head rows); causal LMs embed as they are (last-token pooling)."""
    entry = get_entry(architecture)
    if convert == "auto":
        return architecture
    if convert not in ("embed", "classify"):
        raise ValueError(f"convert must be one of auto, embed, classify; got {convert!r}")
    if convert in entry.tasks:
        return architecture
    target = architecture.replace("ForCausalLM", "ForSequenceClassification")
    if convert == "classify" and target != architecture and target in _REGISTRY:
        return target
    raise UnknownArchitectureError(
        f"architecture {architecture!r} cannot be converted to {convert!r}; it supports "
        f"{', '.join(entry.tasks)}"
    )


def load_model_class(architecture: str) -> type[nn.Module]:
    entry = get_entry(architecture)
    module = importlib.import_module(f"cenote.models.{entry.module}")
    model_class: type[nn.Module] = getattr(module, entry.class_name)
    return model_class
