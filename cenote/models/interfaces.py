"""What the engine asks of a model, declared as protocols (no ``hasattr`` probing).

Every registered model is a ``Model``: a trunk that turns a flat token stream into hidden states.
A decoder adds what sizes its KV cache (``DecoderModel``); heads are further contracts a model
class may satisfy: ``CausalLM`` (logits for sampling and vocabulary scores), ``SequenceScorer``
(a classification / reward head and how it wants to be pooled), ``MaskedLM`` (vocabulary
logits for sparse embeddings). The pooler builder, the model runner and the engine core ask
``isinstance(model, Contract)``; a model class declares every attribute of the contracts it
serves (as class or instance attributes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from cenote.config import ModelConfig
    from cenote.images.batch import ImageBatch
    from cenote.inputs import TextRole
    from cenote.models.checkpoint_map import LinearSlot
    from cenote.models.layers.norm import RMSNorm
    from cenote.models.layers.quant import QuantizedWeight
    from cenote.pooling.activation import Activation
    from cenote.pooling.methods import PoolingMethod


@runtime_checkable
class Model(Protocol):
    """A trunk: ``forward(input_ids, positions, token_type_ids)`` -> hidden states
    ``[num_tokens, hidden_size]``, attention metadata from the forward context. ``hidden_size``
    is what a pooler receives."""

    is_causal: bool  # decoder with a KV cache, or bidirectional encoder
    hidden_size: int

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One flat batch of ``num_tokens`` tokens, the requests back to back:
        ``input_ids [num_tokens]``; ``positions [num_tokens]``, 0-based within each request;
        ``token_type_ids [num_tokens]`` (segment ids) or None, read by the models with
        token-type embeddings (BERT and its heirs, nomic-bert) and ignored by the others
        -> hidden states ``[num_tokens, hidden_size]``."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors (Hugging Face names) in; returns the parameters filled."""
        ...

    def required_parameters(self) -> set[str]:
        """The parameters a checkpoint must fill (the loader names the missing ones)."""
        ...


@runtime_checkable
class DecoderModel(Model, Protocol):
    """A causal trunk with a paged KV cache of ``num_layers`` layers."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_sliding_window: int | None  # set when every layer slides: blocks behind it are freed
    attention_windows: tuple[int | None, ...]  # its layers' distinct windows (None: no window)


@runtime_checkable
class CausalLM(Protocol):
    """A language-model head: hidden rows -> vocabulary logits (sampling, prompt logprobs,
    token scores over the vocabulary)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size]`` -> fp32 ``[N, vocab_size]``."""
        ...


@runtime_checkable
class SequenceScorer(Protocol):
    """A classification (or reward) head and how the pooler should feed it."""

    num_labels: int
    # the sequence pooling of ``classify`` (CLS for BERT heads, LAST for decoders, ModernBERT's
    # configured one); None: the head scores tokens only (``token_classify``)
    classifier_pooling: PoolingMethod | None
    # the activation the head fixes (reward models); None: from the config (problem_type,
    # CrossEncoder activation_fn, number of labels)
    default_activation: Activation | None
    step_tag_id: int | None  # STEP rows for requests that pass none (process reward); None: all

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size]`` -> fp32 scores ``[N, num_labels]``."""
        ...


@runtime_checkable
class ReplaceableHead(Protocol):
    """A classification head that a LoRA adapter's ``modules_to_save`` may replace for its own
    requests (cenote/lora): ``head_modules`` are our names of the linear layers that
    ``compute_scores`` reads (``linear_slot`` maps the adapter's checkpoint names to them)."""

    head_modules: tuple[str, ...]


class ScorerDefaults:
    """The usual ``SequenceScorer`` declarations, for a head class to inherit (first, before
    its trunk) and override where it differs: CLS pooling, the config's activation, no
    default step tag."""

    classifier_pooling: PoolingMethod | None = "cls"
    default_activation: Activation | None = None
    step_tag_id: int | None = None


@runtime_checkable
class ImageTextModel(Model, Protocol):
    """A model with a vision tower (CLIP, SigLIP): image requests carry pixels, their rows in
    the flat batch are placeholders (``num_image_tokens`` each), and ``images`` says which
    requests of the step they are."""

    num_image_tokens: int | None  # rows an image takes; None: no vision tower (text only)
    image_size: int | None  # the square the vision tower sees; None: no vision tower
    embeds_text: bool  # False: no text tower (an image-only folder)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
        images: ImageBatch | None = None,
    ) -> torch.Tensor: ...


@runtime_checkable
class MaskedLM(Protocol):
    """A masked-LM head: hidden rows -> vocabulary logits (SPLADE sparse embeddings)."""

    def compute_mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden [N, hidden_size]`` -> fp32 ``[N, vocab_size]``."""
        ...


@runtime_checkable
class PostLoad(Protocol):
    """A model with work to do once its weights are loaded and cast (e.g. pack the LM head)."""

    def post_load(self) -> None: ...


@runtime_checkable
class QuantizedLoading(Protocol):
    """A model that can keep a GGUF's quantized tensors quantized (cenote/models/layers/quant.py):
    ``prepare_quantized`` empties the modules whose checkpoint tensors all come quantized (on the
    meta device, before allocation), ``load_weights`` takes ``QuantizedWeight``s for them and
    ``finish_quantized`` swaps in the quantized modules."""

    def prepare_quantized(self, names: set[str]) -> None: ...

    def load_weights(
        self, weights: Iterable[tuple[str, torch.Tensor | QuantizedWeight]]
    ) -> set[str]: ...

    def finish_quantized(self, dtype: torch.dtype) -> None: ...


@runtime_checkable
class LoRATarget(Protocol):
    """A model whose linear layers take LoRA adapters (cenote/lora): ``linear_slot`` says
    where a checkpoint weight lives, as ``load_weights`` would copy it."""

    def linear_slot(self, checkpoint_name: str) -> LinearSlot | None:
        """The linear module and output rows that the checkpoint tensor ``checkpoint_name``
        (``<module>.weight``, Hugging Face names) fills, or None where it fills no linear."""
        ...


class PromptFormat(Protocol):
    """A model's own layout of a tokenized pooled text for its role (ColBERT: the query or
    document marker after [CLS], queries padded with [MASK])."""

    def max_length(self, role: TextRole) -> int:
        """Tokens of a formatted text of ``role``, its additions included."""
        ...

    def format(self, ids: list[int], role: TextRole) -> list[int]:
        """``ids`` (``[CLS] tokens [SEP]``, cut to fit) laid out as a text of ``role``."""
        ...


@runtime_checkable
class FormatsPrompts(Protocol):
    """A model class whose pooled texts are laid out by role. Asked of the class with the
    model's config and tokenizer, before any weights load: the input processor (the server's
    front process) has no model instance."""

    @classmethod
    def prompt_format(cls, model_config: ModelConfig, tokenizer: Tokenizer) -> PromptFormat:
        """How this model's texts are laid out."""
        ...


@runtime_checkable
class TaskAdapterModel(Protocol):
    """A model whose checkpoint carries one LoRA adapter per task (Jina v3), placed in its
    layers at load (cenote/lora/tasks.py): a request's ``lora_task`` runs under one."""

    task_adapter_ids: dict[str, int]  # task name -> its adapter id


@dataclass(frozen=True)
class DecodeStackLayer:
    """One pre-norm decoder layer as a fused decode loop runs it: RoPE without q/k norms, a
    SiLU-gated MLP, unscaled scores, each residual add fused into the norm after it."""

    projections: tuple[nn.Module, nn.Module, nn.Module, nn.Module]  # qkv, o, gate_up, down
    post_attention_norm: RMSNorm
    next_norm: RMSNorm  # the next layer's input norm, or the trunk's final norm
    scale: float  # the attention scores' scale
    cache_index: int  # which of the step's KV caches is this layer's


@dataclass(frozen=True)
class DecodeStackSpec:
    """A decoder's layers for a fused decode loop (cenote/runner/decode_stack.py)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    first_norm: RMSNorm  # the first layer's input norm
    layers: list[DecodeStackLayer]
    windows: list[int | None]  # each layer's sliding window (None: full attention)


FusedDecode = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], "torch.Tensor | None"]


@runtime_checkable
class FusedDecodeModel(Protocol):
    """A decoder whose layers a runner may run as one fused decode loop: it describes them and
    calls the loop it is given (``fused(embeddings, cos, sin)``) before its own, which runs
    where the loop returns None."""

    def decode_stack_spec(self) -> DecodeStackSpec | None:
        """The layers, or None where they do not fit the loop (q/k norms, another activation,
        soft-capped scores)."""
        ...

    def use_fused_decode(self, fused: FusedDecode) -> None: ...
