"""Architecture name -> (module, class), imported lazily. No name guessing."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from cenote.errors import UnknownArchitectureError
from cenote.models.formats.st_config import is_pylate_folder
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

# (is_causal, tasks) -> {architecture: (module, class)}
_TABLES: dict[tuple[bool, tuple[SupportedTask, ...]], dict[str, tuple[str, str]]] = {
    (False, _ENCODER_TASKS): {
        "BertModel": ("bert", "BertModel"),
        "RobertaModel": ("bert", "RobertaModel"),
        "XLMRobertaModel": ("bert", "RobertaModel"),
        "MPNetModel": ("mpnet", "MPNetModel"),
        "DistilBertModel": ("distilbert", "DistilBertModel"),
        "ModernBertModel": ("modernbert", "ModernBertModel"),
        "NomicBertModel": ("nomic_bert", "NomicBertModel"),
        "T5EncoderModel": ("t5_encoder", "T5EncoderModel"),
        "MT5EncoderModel": ("t5_encoder", "T5EncoderModel"),
        "DebertaV2Model": ("deberta_v2", "DebertaV2Model"),
        # GTE v1.5 / multilingual: Alibaba-NLP's remote-code name and transformers' native one
        "NewModel": ("gte", "GteModel"),
        "GteModel": ("gte", "GteModel"),
        # jina-embeddings-v2: the Hub's config.json names the masked LM (its head is not loaded)
        "JinaBertModel": ("jina_bert", "JinaBertModel"),
        "JinaBertForMaskedLM": ("jina_bert", "JinaBertModel"),
        # jina-embeddings-v3: XLM-R with rotary positions and per-task LoRA adapters
        "XLMRobertaLoRA": ("jina_v3", "XLMRobertaLoRA"),
        # EmbeddingGemma: the Gemma 3 trunk as a (bidirectional) encoder
        "Gemma3TextModel": ("gemma3", "Gemma3TextModel"),
    },
    (False, ("classify",)): {
        "BertForSequenceClassification": ("bert_classifiers", "BertForSequenceClassification"),
        "RobertaForSequenceClassification": (
            "bert_classifiers",
            "RobertaForSequenceClassification",
        ),
        "XLMRobertaForSequenceClassification": (
            "bert_classifiers",
            "RobertaForSequenceClassification",
        ),
        "MPNetForSequenceClassification": ("mpnet", "MPNetForSequenceClassification"),
        "DistilBertForSequenceClassification": (
            "distilbert",
            "DistilBertForSequenceClassification",
        ),
        "ModernBertForSequenceClassification": (
            "modernbert",
            "ModernBertForSequenceClassification",
        ),
        "DebertaV2ForSequenceClassification": (
            "deberta_v2",
            "DebertaV2ForSequenceClassification",
        ),
        "NewForSequenceClassification": ("gte", "GteForSequenceClassification"),
        "GteForSequenceClassification": ("gte", "GteForSequenceClassification"),
        "JinaBertForSequenceClassification": ("jina_bert", "JinaBertForSequenceClassification"),
    },
    (False, ("token_classify",)): {
        "BertForTokenClassification": ("bert_classifiers", "BertForTokenClassification"),
    },
    # masked LMs serve sparse (SPLADE) embeddings over their vocabulary logits
    (False, ("embed_sparse",)): {
        "BertForMaskedLM": ("masked_lm", "BertForMaskedLM"),
        "DistilBertForMaskedLM": ("distilbert", "DistilBertForMaskedLM"),
    },
    # BGE-M3: an XLM-R folder with sparse_linear.pt and colbert_linear.pt (bge_m3_architecture)
    (False, ("embed", "embed_sparse", "token_embed")): {
        "BgeM3EmbeddingModel": ("bge_m3", "BgeM3Model"),
    },
    # two towers projecting texts and images into one space (images are prompts), or one
    # tower alone (a vision-only folder needs no tokenizer: VISION_ONLY_ARCHITECTURES)
    (False, ("embed",)): {
        "CLIPModel": ("clip", "ClipModel"),
        "CLIPTextModelWithProjection": ("clip", "ClipModel"),
        "CLIPVisionModelWithProjection": ("clip", "ClipModel"),
        # one tower without projection: transformers' pooler_output
        "CLIPTextModel": ("clip", "ClipTowerModel"),
        "CLIPVisionModel": ("clip", "ClipTowerModel"),
        "SiglipModel": ("siglip", "SiglipModel"),
        "SiglipTextModel": ("siglip", "SiglipModel"),
        "SiglipVisionModel": ("siglip", "SiglipModel"),
    },
    # colbert-ai checkpoints: BERT + linear, token vectors for late interaction (MaxSim)
    (False, ("token_embed",)): {
        "HF_ColBERT": ("colbert", "HFColBERT"),
        # PyLate / MultiVectorEncoder folders: a trunk + Dense (pylate_architecture)
        "PyLateBertModel": ("pylate", "PyLateBertModel"),
        "PyLateModernBertModel": ("pylate", "PyLateModernBertModel"),
    },
    (True, _DECODER_TASKS): {
        "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
        "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
        "Qwen2ForCausalLM": ("llama", "Qwen2ForCausalLM"),
        "Qwen3ForCausalLM": ("llama", "Qwen3ForCausalLM"),
        "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
    },
    (True, _SEQ_CLS_TASKS): {
        "LlamaForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
        "MistralForSequenceClassification": ("llama", "LlamaForSequenceClassification"),
        "Qwen2ForSequenceClassification": ("llama", "Qwen2ForSequenceClassification"),
        "Qwen3ForSequenceClassification": ("llama", "Qwen3ForSequenceClassification"),
        # reward per token (ALL) or per prompt (last token)
        "Qwen2ForRewardModel": ("qwen2_reward", "Qwen2ForRewardModel"),
    },
    # process reward at the step tags (STEP)
    (True, ("token_classify",)): {
        "Qwen2ForProcessRewardModel": ("qwen2_reward", "Qwen2ForProcessRewardModel"),
    },
}
_REGISTRY: dict[str, ModelEntry] = {
    architecture: ModelEntry(module, class_name, is_causal, tasks)
    for (is_causal, tasks), table in _TABLES.items()
    for architecture, (module, class_name) in table.items()
}


# image-only folders: they embed images, so a folder without tokenizer.json is served with an
# empty tokenizer (texts are refused at the edge, ModelCapabilities.embeds_text)
VISION_ONLY_ARCHITECTURES = frozenset(
    {"CLIPVisionModel", "CLIPVisionModelWithProjection", "SiglipVisionModel"}
)


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def get_entry(architecture: str) -> ModelEntry:
    if architecture not in _REGISTRY:
        raise UnknownArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(supported_architectures())}"
        )
    return _REGISTRY[architecture]


BGE_M3_ARCHITECTURE = "BgeM3EmbeddingModel"  # vLLM's name (there given by hf_overrides)
SPARSE_HEAD_FILE = "sparse_linear.pt"  # BGE-M3's lexical-weight head: Linear(hidden, 1)
COLBERT_HEAD_FILE = "colbert_linear.pt"  # BGE-M3's ColBERT head: Linear(hidden, colbert_dim)


def bge_m3_architecture(folder: Path, architecture: str) -> str:
    """``BgeM3EmbeddingModel`` for an XLM-R folder with both BGE-M3 heads beside it, else
    ``architecture`` unchanged."""
    if architecture != "XLMRobertaModel" or not folder.is_dir():
        return architecture
    if (folder / SPARSE_HEAD_FILE).is_file() and (folder / COLBERT_HEAD_FILE).is_file():
        return BGE_M3_ARCHITECTURE
    return architecture


PYLATE_TRUNKS = {"BertModel": "PyLateBertModel", "ModernBertModel": "PyLateModernBertModel"}


def pylate_architecture(folder: Path, architecture: str) -> str:
    """``PyLate<Trunk>`` for a PyLate ColBERT folder (``is_pylate_folder``), else
    ``architecture`` unchanged; a PyLate folder over another trunk is refused."""
    if not folder.is_dir() or not is_pylate_folder(folder):
        return architecture
    if architecture not in PYLATE_TRUNKS:
        raise UnknownArchitectureError(
            f"{folder} is a PyLate ColBERT folder over {architecture!r}; supported trunks: "
            f"{', '.join(PYLATE_TRUNKS)}"
        )
    return PYLATE_TRUNKS[architecture]


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
