"""Jina v3 (jinaai/jina-embeddings-v3, ``XLMRobertaLoRA``) over a flat, unpadded token stream.

XLM-R's post-norm layers with rotary position embeddings (neox layout, ``rotary_emb_base``,
positions from 0) instead of learned ones, and one LoRA adapter per task (``lora_adaptations``:
retrieval.query, retrieval.passage, separation, classification, text-matching) on every linear
and embedding of the trunk. A request picks its task (``PoolingParams.lora_task``, the ``task``
of Jina's API); without one it runs the base weights, as the remote code's ``encode()`` without
``task`` does.

Checkpoint (the remote code jinaai/xlm-roberta-flash-implementation, ``roberta.`` prefix):
``embeddings.{word,token_type}_embeddings``, ``emb_ln``, ``encoder.layers.N.mixer.Wqkv`` (fused
q/k/v), ``mixer.out_proj``, ``norm1``, ``mlp.fc1``, ``mlp.fc2``, ``norm2``. Adapted modules are
torch parametrizations: the weight is ``<module>.parametrizations.weight.original`` and the task
factors, stacked by task, ``...parametrizations.weight.0.lora_A`` / ``lora_B``:

- linear ``[out, in]``: ``lora_A [tasks, r, in]``, ``lora_B [tasks, out, r]``,
  ``W_t = W + s * B_t @ A_t``;
- embedding ``[rows, dim]``: ``lora_A [tasks, rows, r]``, ``lora_B [tasks, r, dim]``,
  ``E_t = E + s * A_t @ B_t``;

with ``s = lora_alpha / lora_rank``. transformers' native ``JinaEmbeddingsV3Model`` computes the
same trunk (its conversion mapping reads these names; it drops the adapters).

Tasks run as LoRA adapters of the base (``cenote/lora/tasks.py``), not as merged copies: the
linears' updates go through the shared ``LoRAHost`` path, so a step mixes tasks and the base
matmul runs once; the embeddings' updates are row gathers of ``A_t`` times ``B_t``, here.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.lora_request import TASK_ADAPTER_ID_BASE
from cenote.models.checkpoint_map import CheckpointMap, LinearSlot, Slot, linear_slots
from cenote.models.layers.attention import Attention
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import GELU_APPROXIMATE, TrunkLinear, linear_add_norm, linear_gelu
from cenote.models.layers.lora import LoRABlock, LoRAHost, active_lora_batch
from cenote.models.layers.norm import LayerNorm
from cenote.models.layers.rotary import RotaryEmbedding, apply_rotary

_PARAMETRIZED = re.compile(
    r"^(?P<module>.+)\.parametrizations\.weight\.(?P<part>original|0\.lora_A|0\.lora_B)$"
)
# remote-code config key -> the only value implemented here (absent keys take these)
_REQUIRED: dict[str, Any] = {"position_embedding_type": "rotary", "lora_dropout_p": 0.0}


def check_variant(config: dict[str, Any]) -> None:
    """Refuse what this implementation does not compute, naming what it supports."""
    for key, value in _REQUIRED.items():
        if config.get(key, value) != value:
            raise ValueError(
                f"Jina v3 {key}={config[key]!r} is not supported; supported: {value!r}"
            )
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    rotary_dim = config.get("rotary_emb_dim") or head_dim
    if rotary_dim != head_dim:
        raise ValueError(
            f"Jina v3 rotary_emb_dim={rotary_dim} is not supported; supported: the head size "
            f"({head_dim})"
        )
    if config.get("rotary_emb_interleaved", False):
        raise ValueError("Jina v3 rotary_emb_interleaved=true is not supported; supported: false")


def _linear_shape(module: nn.Module) -> tuple[int, int]:
    """``(out_features, in_features)`` of a dense or quantized linear layer."""
    rows, cols = module.out_features, module.in_features
    assert isinstance(rows, int) and isinstance(cols, int)
    return rows, cols


class JinaV3Layer(nn.Module):
    """``x = norm1(x + out_proj(attn(rope(Wqkv x))))``; ``x = norm2(x + fc2(gelu(fc1 x)))``."""

    def __init__(self, config: dict[str, Any], layer_idx: int) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        eps = config.get("layer_norm_eps", 1e-5)
        head_dim = hidden // heads
        self.qkv = TrunkLinear(hidden, 3 * hidden)
        self.attn = Attention(heads, head_dim, heads, layer_idx, head_dim**-0.5)
        self.out_proj = TrunkLinear(hidden, hidden)
        self.norm1 = LayerNorm(hidden, eps=eps)
        self.fc1 = TrunkLinear(hidden, config["intermediate_size"])
        self.fc2 = TrunkLinear(config["intermediate_size"], hidden)
        self.norm2 = LayerNorm(hidden, eps=eps)
        activation = config.get("hidden_act", "gelu")
        if activation not in GELU_APPROXIMATE:
            raise ValueError(f"Jina v3 hidden_act {activation!r} is not supported; supported: gelu")
        self.gelu_approximate = GELU_APPROXIMATE[activation]

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        x = linear_add_norm(self.out_proj, self.attn(q, k, v), x, self.norm1)
        inner = linear_gelu(self.fc1, x, self.gelu_approximate)  # [num_tokens, intermediate]
        return linear_add_norm(self.fc2, inner, x, self.norm2)


# checkpoint name (after ``encoder.layers.N.``) -> ours (after ``layers.N.``)
_LAYER_NAMES = {
    "mixer.Wqkv": "qkv",
    "mixer.out_proj": "out_proj",
    "norm1": "norm1",
    "mlp.fc1": "fc1",
    "mlp.fc2": "fc2",
    "norm2": "norm2",
}
_EMBEDDINGS = ("word_embeddings", "token_type_embeddings")


class XLMRobertaLoRA(nn.Module):
    """``forward(input_ids, positions, token_type_ids) -> hidden_states [num_tokens, hidden]``;
    rows of a step's LoRA groups whose adapter is one of the checkpoint's tasks run that task.
    ``task_adapter_ids``: task name -> its adapter id (``cenote/lora/tasks.py``)."""

    is_causal = False

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        check_variant(config)
        self.config = config
        hidden = self.hidden_size = int(config["hidden_size"])
        head_dim = hidden // int(config["num_attention_heads"])
        theta = float(config.get("rotary_emb_base", 10000.0))
        self.rotary = RotaryEmbedding(head_dim, {"rope_theta": theta})
        self.word_embeddings = Embedding(config["vocab_size"], hidden)
        self.token_type_embeddings = Embedding(int(config.get("type_vocab_size", 1)), hidden)
        self.emb_ln = LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-5))
        self.layers = nn.ModuleList(
            JinaV3Layer(config, i) for i in range(config["num_hidden_layers"])
        )
        tasks = list(config.get("lora_adaptations") or [])
        self.task_adapter_ids = {t: TASK_ADAPTER_ID_BASE + i for i, t in enumerate(tasks)}
        self.lora_scaling = float(config.get("lora_alpha", 1)) / float(config.get("lora_rank", 1))
        # checkpoint module name -> (lora_A, lora_B) stacked by task, as read (fp32, host)
        self._task_factors: dict[str, dict[str, Tensor]] = {}
        # embedding name -> adapter id -> (A_t [rows, r], s * B_t [r, dim]), built by post_load
        self._embedding_lora: dict[str, dict[int, tuple[Tensor, Tensor]]] = {}
        self.checkpoint_map = CheckpointMap(
            self._slots(), prefixes=("roberta.",), unused=("pooler.", "lm_head.")
        )

    def _slots(self) -> dict[str, Slot]:
        slots = {f"embeddings.{name}.weight": Slot(f"{name}.weight") for name in _EMBEDDINGS}
        slots.update(linear_slots("emb_ln", "emb_ln"))
        for i in range(len(self.layers)):
            for name, ours in _LAYER_NAMES.items():
                slots.update(linear_slots(f"encoder.layers.{i}.{name}", f"layers.{i}.{ours}"))
        return slots

    # ---- loading ----------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        """Base weights into their slots; the parametrizations' task factors kept aside for
        ``post_load`` (after the cast to the runtime dtype)."""

        def base_weights() -> Iterable[tuple[str, Tensor]]:
            for name, tensor in weights:
                match = _PARAMETRIZED.match(self.checkpoint_map.key(name))
                if match is None:
                    yield name, tensor
                elif match["part"] == "original":
                    yield f"{match['module']}.weight", tensor
                elif not match["module"].startswith(self.checkpoint_map.unused):
                    factors = self._task_factors.setdefault(match["module"], {})
                    factors[match["part"].removeprefix("0.")] = tensor.float()

        return self.checkpoint_map.load(self, base_weights())

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()

    def post_load(self) -> None:
        """Every task's factors placed: linears get ``LoRABlock``s (``s * B`` folded in), the
        embeddings keep ``A_t`` and ``s * B_t``; shapes checked against the base weights."""
        weight = self.word_embeddings.weight
        dtype, device = weight.dtype, weight.device
        small = device.type == "cpu" and dtype != torch.float32  # fp32 copies for short runs
        if self.task_adapter_ids and not self._task_factors:
            raise ValueError(
                f"Jina v3: config.json lists {len(self.task_adapter_ids)} lora_adaptations "
                "but the checkpoint has no parametrizations.weight.0.lora_A / lora_B tensors"
            )
        for module_name, factors in self._task_factors.items():
            a, b = factors.get("lora_A"), factors.get("lora_B")
            if a is None or b is None:
                raise ValueError(f"Jina v3 checkpoint: {module_name} has one LoRA factor of two")
            self._check_factors(module_name, a, b)
            target = self._module_of(module_name)
            for index, adapter_id in enumerate(self.task_adapter_ids.values()):
                if isinstance(target, LoRAHost):  # a [t] [r, in], b [t] [out, r]
                    a_t, b_t = a[index], b[index] * self.lora_scaling
                    target.lora_blocks[adapter_id] = (
                        LoRABlock(
                            a_t.to(device, dtype).contiguous(),
                            b_t.to(device, dtype).contiguous(),
                            0,
                            b_t.shape[0],
                            a_t.to(device).contiguous() if small else None,
                            b_t.to(device).contiguous() if small else None,
                        ),
                    )
                else:  # embedding: a [t] [rows, r], b [t] [r, dim]
                    embedding = self._embedding_lora.setdefault(module_name.rsplit(".")[-1], {})
                    embedding[adapter_id] = (
                        a[index].to(device).contiguous(),
                        (b[index] * self.lora_scaling).to(device).contiguous(),
                    )
        self._task_factors = {}

    def _module_of(self, module_name: str) -> nn.Module:
        """Our module for a checkpoint module name (``encoder.layers.3.mixer.Wqkv``)."""
        slot = self.checkpoint_map.slots.get(f"{module_name}.weight")
        if slot is None:
            raise ValueError(
                f"Jina v3 checkpoint: LoRA factors on {module_name!r}, not a module here"
            )
        return self.get_submodule(slot.param.removesuffix(".weight"))

    def _check_factors(self, module_name: str, a: Tensor, b: Tensor) -> None:
        target = self._module_of(module_name)
        tasks = len(self.task_adapter_ids)
        if isinstance(target, nn.Embedding):
            rows, cols = target.weight.shape
            expected = ((tasks, rows, a.shape[2]), (tasks, a.shape[2], cols))
        else:  # a linear, dense or quantized (--quantization int8 / int4)
            rows, cols = _linear_shape(target)
            expected = ((tasks, a.shape[1], cols), (tasks, rows, a.shape[1]))
        if (tuple(a.shape), tuple(b.shape)) != expected:
            raise ValueError(
                f"Jina v3 checkpoint: {module_name} lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)} do not fit its weight ({rows}, {cols}) and the "
                f"{tasks} tasks of lora_adaptations; expected {expected[0]} / {expected[1]}"
            )

    # ---- LoRA target ------------------------------------------------------------------------

    def linear_slot(self, checkpoint_name: str) -> LinearSlot | None:
        """Where ``<module>.weight`` lives (``LoRATarget``), for adapter folders on this base."""
        slot = self.checkpoint_map.slots.get(self.checkpoint_map.key(checkpoint_name))
        if slot is None or not slot.param.endswith(".weight"):
            return None
        module = self.get_submodule(slot.param.removesuffix(".weight"))
        if not isinstance(module, LoRAHost) or not isinstance(module, nn.Module):
            return None
        return LinearSlot(slot.param.removesuffix(".weight"), 0, _linear_shape(module)[0])

    # ---- forward ----------------------------------------------------------------------------

    def forward(
        self, input_ids: Tensor, positions: Tensor, token_type_ids: Tensor | None = None
    ) -> Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        self._add_embedding_lora(
            x, {"word_embeddings": input_ids, "token_type_embeddings": token_type_ids}
        )
        x = self.emb_ln.normalize_(x)  # [num_tokens, hidden]; x: this step's sum
        cos, sin = self.rotary.cos_sin(positions)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x  # [num_tokens, hidden]

    def _add_embedding_lora(self, x: Tensor, ids: dict[str, Tensor]) -> None:
        """Each task row's embedding updates, ``A_t[id] @ (s B_t)``, added to ``x`` in place."""
        batch = active_lora_batch()
        if batch is None or not self._embedding_lora:
            return
        for group in batch.groups:
            for name, per_task in self._embedding_lora.items():
                factors = per_task.get(group.adapter_id)
                if factors is None:
                    continue
                a, b = factors
                delta = a[ids[name][group.rows]] @ b  # [num_rows, hidden], fp32
                x[group.rows] += delta.to(x.dtype)
