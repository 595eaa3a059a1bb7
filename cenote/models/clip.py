"""CLIP: a text tower and a vision tower whose pooled outputs are projected into one space
(``CLIPModel``, and the one-tower folders ``CLIPTextModelWithProjection`` /
``CLIPVisionModelWithProjection``: a request for the tower a folder lacks is refused at the
edge, ``embeds_text`` and ``num_image_tokens``; ``CLIPVisionModel`` / ``CLIPTextModel``, a
tower without projection, embed as their ``pooler_output``). SigLIP (``siglip.py``) builds on
the same towers.

An image request's rows in the flat batch are placeholders, one per image token (its patches
and the class token), so the scheduler budgets images as it budgets text; the vision tower reads
the request's pixel values (``ImageBatch``). The towers differ in width, so the trunk pools
inside: it returns ``[num_tokens, embed_dim]`` whose first row of each request holds that
request's embedding (text: the EOS row, image: the class token, each projected) and whose other
rows are zero; the engine's CLS pooling reads it. Text and image requests share a step: each
tower runs on its own requests' rows, with attention metadata of those requests only.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from cenote.config import ModelConfig
from cenote.forward_context import AttentionMetadata, forward_context, get_attention_metadata
from cenote.images.batch import ImageBatch
from cenote.models.checkpoint_map import CheckpointMap, Slot, fused_slots, linear_slots
from cenote.models.layers.activation import get_activation
from cenote.models.layers.attention import Attention
from cenote.models.layers.embedding import Embedding
from cenote.models.layers.linear import GELU_APPROXIMATE, TrunkLinear, linear_add, linear_gelu
from cenote.models.layers.norm import LayerNorm

# HF's per-layer names -> ours (q/k/v are fused into ``qkv``)
_LAYER_NAMES = {
    "self_attn.out_proj": "out_proj",
    "layer_norm1": "layer_norm1",
    "layer_norm2": "layer_norm2",
    "mlp.fc1": "fc1",
    "mlp.fc2": "fc2",
}
_QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]


class PreNormEncoderLayer(nn.Module):
    """``x + attn(ln1(x))``, then ``x + fc2(act(fc1(ln2(x))))`` (CLIP and SigLIP layers)."""

    def __init__(self, config: dict[str, Any], layer_idx: int, causal: bool) -> None:
        super().__init__()
        hidden, heads = config["hidden_size"], config["num_attention_heads"]
        eps = config.get("layer_norm_eps", 1e-5)
        head_dim = hidden // heads
        self.layer_norm1 = LayerNorm(hidden, eps=eps)
        self.qkv = TrunkLinear(hidden, 3 * hidden)
        self.attn = Attention(heads, head_dim, heads, layer_idx, head_dim**-0.5, causal=causal)
        self.out_proj = TrunkLinear(hidden, hidden)
        self.layer_norm2 = LayerNorm(hidden, eps=eps)
        self.fc1 = TrunkLinear(hidden, config["intermediate_size"])
        self.fc2 = TrunkLinear(config["intermediate_size"], hidden)
        activation = config.get("hidden_act", "quick_gelu")
        self.act = get_activation(activation)
        self.gelu_approximate = GELU_APPROXIMATE.get(activation)  # None: not a plain GELU

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(self.layer_norm1(x)).chunk(3, dim=-1)
        x = linear_add(self.out_proj, self.attn(q, k, v), x)
        h = self.layer_norm2(x)
        if self.gelu_approximate is None:
            inner = self.act(self.fc1(h))
        else:
            inner = linear_gelu(self.fc1, h, self.gelu_approximate)
        return linear_add(self.fc2, inner, x)  # [num_tokens, hidden]


def layer_slots(prefix: str, ours: str, num_layers: int) -> dict[str, Slot]:
    """Checkpoint slots of ``{prefix}encoder.layers.{i}.*`` -> ``{ours}layers.{i}.*``."""
    slots: dict[str, Slot] = {}
    for i in range(num_layers):
        hf, mine = f"{prefix}encoder.layers.{i}.", f"{ours}layers.{i}."
        slots.update(fused_slots([hf + name for name in _QKV], mine + "qkv"))
        for name, our_name in _LAYER_NAMES.items():
            slots.update(linear_slots(hf + name, mine + our_name))
    return slots


class TextTower(nn.Module):
    """Token + position embeddings, pre-norm layers, a final LayerNorm; pools one row per
    request (CLIP: the first EOS, or the largest id when ``eos_token_id`` is 2, as transformers'
    legacy configs; SigLIP: the last row)."""

    def __init__(
        self, config: dict[str, Any], causal: bool, pool_last: bool, pad: bool = False
    ) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.hidden_size = hidden
        self.max_position = int(config.get("max_position_embeddings", 77))
        self.token_embedding = Embedding(config["vocab_size"], hidden)
        self.position_embedding = Embedding(self.max_position, hidden)
        self.layers = nn.ModuleList(
            PreNormEncoderLayer(config, i, causal) for i in range(config["num_hidden_layers"])
        )
        self.final_layer_norm = LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-5))
        self.eos_token_id = config.get("eos_token_id", 2)
        self.pool_last = pool_last
        # SigLIP: texts are padded to the position limit (no attention mask), as it was trained
        self.pad_to = self.max_position if pad else None
        self.pad_token_id = int(config.get("pad_token_id", 1))

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        """Rows of the text requests in the forward context -> last hidden states
        ``[num_tokens, hidden]`` (after the final LayerNorm, as transformers returns them)."""
        x = self.token_embedding(input_ids) + self.position_embedding(positions)
        for layer in self.layers:
            x = layer(x)
        return self.final_layer_norm(x)

    def pooled_rows(self, input_ids: list[int], query_start_loc: list[int]) -> list[int]:
        """The row each request is pooled from."""
        rows = []
        for start, end in zip(query_start_loc, query_start_loc[1:], strict=False):
            ids = input_ids[start:end]
            if self.pool_last:
                offset = len(ids) - 1
            elif self.eos_token_id == 2:
                offset = max(range(len(ids)), key=ids.__getitem__)
            else:
                offset = ids.index(self.eos_token_id) if self.eos_token_id in ids else 0
            rows.append(start + offset)
        return rows

    @staticmethod
    def slots(prefix: str, num_layers: int) -> dict[str, Slot]:
        slots = {
            f"{prefix}embeddings.token_embedding.weight": Slot(f"{prefix}token_embedding.weight"),
            f"{prefix}embeddings.position_embedding.weight": Slot(
                f"{prefix}position_embedding.weight"
            ),
            **linear_slots(f"{prefix}final_layer_norm", f"{prefix}final_layer_norm"),
        }
        return {**slots, **layer_slots(prefix, prefix, num_layers)}


class VisionTower(nn.Module):
    """Patch embedding (a strided convolution), class token (CLIP), position embeddings,
    pre-LayerNorm (CLIP), pre-norm layers; ``forward`` returns the last hidden states."""

    def __init__(self, config: dict[str, Any], class_token: bool, patch_bias: bool) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        eps = config.get("layer_norm_eps", 1e-5)
        self.hidden_size = hidden
        self.image_size = int(config.get("image_size", 224))
        self.patch_size = int(config.get("patch_size", 32))
        self.num_tokens = image_token_count(config, class_token)
        self.patch_embedding = nn.Conv2d(
            config.get("num_channels", 3),
            hidden,
            kernel_size=self.patch_size,
            stride=self.patch_size,
            bias=patch_bias,
        )
        self.class_embedding = nn.Parameter(torch.empty(hidden)) if class_token else None
        self.position_embedding = Embedding(self.num_tokens, hidden)
        self.pre_layrnorm = LayerNorm(hidden, eps=eps) if class_token else None
        self.layers = nn.ModuleList(
            PreNormEncoderLayer(config, i, False) for i in range(config["num_hidden_layers"])
        )
        self.post_layernorm = LayerNorm(hidden, eps=eps)

    def forward(self, pixel_values: Tensor) -> Tensor:
        """``pixel_values [num_images, channels, size, size]`` -> ``[num_images, num_tokens,
        hidden]``, every image's tokens attending among themselves."""
        num_images = pixel_values.shape[0]
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixel_values.to(weight.device, weight.dtype))
        x = patches.flatten(2).transpose(1, 2)  # [num_images, num_patches, hidden]
        if self.class_embedding is not None:
            x = torch.cat([self.class_embedding.expand(num_images, 1, -1), x], dim=1)
        x = x + self.position_embedding.weight  # [num_images, num_tokens, hidden]
        if self.pre_layrnorm is not None:
            x = self.pre_layrnorm(x)
        n = self.num_tokens
        metadata = AttentionMetadata(
            query_start_loc=list(range(0, (num_images + 1) * n, n)),
            seq_lens=[n] * num_images,
            causal=False,
            device=weight.device,
        )
        rows = x.reshape(num_images * n, self.hidden_size)
        with forward_context(metadata):
            for layer in self.layers:
                rows = layer(rows)
        return rows.view(num_images, n, self.hidden_size)

    @staticmethod
    def slots(prefix: str, num_layers: int, class_token: bool, patch_bias: bool) -> dict[str, Slot]:
        slots = {
            **linear_slots(
                f"{prefix}embeddings.patch_embedding", f"{prefix}patch_embedding", patch_bias
            ),
            f"{prefix}embeddings.position_embedding.weight": Slot(
                f"{prefix}position_embedding.weight"
            ),
            **linear_slots(f"{prefix}post_layernorm", f"{prefix}post_layernorm"),
        }
        if class_token:
            slots[f"{prefix}embeddings.class_embedding"] = Slot(f"{prefix}class_embedding")
            slots.update(linear_slots(f"{prefix}pre_layrnorm", f"{prefix}pre_layrnorm"))
        return {**slots, **layer_slots(prefix, prefix, num_layers)}


def image_token_count(vision_config: dict[str, Any], class_token: bool) -> int:
    """Tokens an image takes: one per patch, plus the class token (CLIP)."""
    size, patch = (
        int(vision_config.get("image_size", 224)),
        int(vision_config.get("patch_size", 32)),
    )
    return (size // patch) ** 2 + int(class_token)


def tower_configs(config: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(text config, vision config) of a two-tower or one-tower folder (None: no such tower)."""
    if "text_config" in config or "vision_config" in config:
        return config.get("text_config"), config.get("vision_config")
    if config.get("model_type", "").endswith("vision_model") or "image_size" in config:
        return None, config
    return config, None


class ClipModel(nn.Module):
    """The towers the folder has, each with its projection; see the module docstring."""

    is_causal = False
    class_token = True  # CLIP's vision tower has a class token; SigLIP's has none
    unused_checkpoint_names: tuple[str, ...] = (
        "logit_scale",
        "text_model.embeddings.position_ids",
        "vision_model.embeddings.position_ids",
    )

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__()
        config = model_config.hf_config
        text_config, vision_config = tower_configs(config)
        self.text_model = self._text_tower(text_config) if text_config else None
        self.vision_model = self._vision_tower(vision_config) if vision_config else None
        self.hidden_size = self._embed_dim(config, text_config, vision_config)
        self._build_heads(text_config, vision_config)
        self.checkpoint_map = CheckpointMap(
            self._slots(text_config, vision_config), unused=self.unused_checkpoint_names
        )

    # ---- what differs between CLIP and SigLIP -----------------------------------------------

    def _text_tower(self, config: dict[str, Any]) -> TextTower:
        return TextTower(config, causal=True, pool_last=False)

    def _vision_tower(self, config: dict[str, Any]) -> VisionTower:
        return VisionTower(config, class_token=True, patch_bias=False)

    def _embed_dim(
        self, config: dict[str, Any], text: dict[str, Any] | None, vision: dict[str, Any] | None
    ) -> int:
        return int(config.get("projection_dim", 512))

    def _build_heads(self, text: dict[str, Any] | None, vision: dict[str, Any] | None) -> None:
        embed = self.hidden_size
        self.text_projection = (
            nn.Linear(text["hidden_size"], embed, bias=False) if text is not None else None
        )
        self.visual_projection = (
            nn.Linear(vision["hidden_size"], embed, bias=False) if vision is not None else None
        )

    def _slots(self, text: dict[str, Any] | None, vision: dict[str, Any] | None) -> dict[str, Slot]:
        slots: dict[str, Slot] = {}
        if text is not None:
            slots.update(TextTower.slots("text_model.", text["num_hidden_layers"]))
            slots.update(linear_slots("text_projection", "text_projection", bias=False))
        if vision is not None:
            layers = vision["num_hidden_layers"]
            slots.update(VisionTower.slots("vision_model.", layers, True, False))
            slots.update(linear_slots("visual_projection", "visual_projection", bias=False))
        return slots

    def text_embeddings(self, hidden: Tensor, rows: list[int]) -> Tensor:
        """``[len(rows), embed_dim]``: the pooled rows of the text tower, projected."""
        assert self.text_projection is not None
        return self.text_projection(hidden[rows])

    def image_embeddings(self, hidden: Tensor) -> Tensor:
        """``hidden [num_images, num_tokens, hidden]`` -> ``[num_images, embed_dim]``."""
        assert self.vision_model is not None and self.visual_projection is not None
        return self.visual_projection(self.vision_model.post_layernorm(hidden[:, 0]))

    # ---- the trunk --------------------------------------------------------------------------

    @property
    def num_image_tokens(self) -> int | None:
        """Rows an image takes in a step (None: no vision tower)."""
        return None if self.vision_model is None else self.vision_model.num_tokens

    @property
    def image_size(self) -> int | None:
        """The square the vision tower sees (None: no vision tower)."""
        return None if self.vision_model is None else self.vision_model.image_size

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        token_type_ids: Tensor | None = None,
        images: ImageBatch | None = None,
    ) -> Tensor:
        metadata = get_attention_metadata()
        starts = metadata.query_start_loc
        dtype = self.text_or_vision_dtype()
        out = torch.zeros(
            input_ids.shape[0], self.hidden_size, dtype=dtype, device=input_ids.device
        )
        image_requests = set(images.request_indices) if images is not None else set()
        # 1) text requests: the text tower over their rows only
        texts = [i for i in range(metadata.num_requests) if i not in image_requests]
        if texts:
            if self.text_model is None:
                raise ValueError("this model has no text tower; it embeds images only")
            out[[starts[i] for i in texts]] = self._embed_texts(input_ids, positions, starts, texts)
        # 2) image requests: the vision tower over their pixels
        if images is not None:
            hidden = self.vision_model_or_raise()(images.pixel_values)
            out[[starts[i] for i in images.request_indices]] = self.image_embeddings(hidden)
        return out  # [num_tokens, embed_dim]: each request's embedding on its first row

    def _embed_texts(
        self, input_ids: Tensor, positions: Tensor, starts: list[int], texts: list[int]
    ) -> Tensor:
        tower = self.text_model
        assert tower is not None
        device = input_ids.device
        rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in texts]).to(device)
        ids, text_positions = input_ids[rows], positions[rows]
        lens = [starts[i + 1] - starts[i] for i in texts]
        if tower.pad_to is not None:  # SigLIP: every text padded to the length it was trained on
            ids, text_positions = _pad_texts(ids, lens, tower.pad_to, tower.pad_token_id)
            lens = [tower.pad_to] * len(texts)
        query_start_loc = [0]
        for length in lens:
            query_start_loc.append(query_start_loc[-1] + length)
        metadata = AttentionMetadata(
            query_start_loc=query_start_loc, seq_lens=lens, causal=False, device=device
        )
        with forward_context(metadata):
            hidden = tower(ids, text_positions)
        pooled = tower.pooled_rows(ids.tolist(), query_start_loc)
        return self.text_embeddings(hidden, pooled)  # [num_texts, embed_dim]

    def vision_model_or_raise(self) -> VisionTower:
        if self.vision_model is None:
            raise ValueError("this model has no vision tower; it embeds texts only")
        return self.vision_model

    def text_or_vision_dtype(self) -> torch.dtype:
        """The trunk's dtype (what its outputs are written in)."""
        return next(self.parameters()).dtype

    @property
    def embeds_text(self) -> bool:
        """Whether the folder has a text tower (False: an image-only folder)."""
        return self.text_model is not None

    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> set[str]:
        # transformers 5 saves SiglipTextModel / SiglipVisionModel without their tower's prefix
        if self.vision_model is None:
            weights = ((_tower_name(name, "text_model."), tensor) for name, tensor in weights)
        elif self.text_model is None:
            weights = ((_tower_name(name, "vision_model."), tensor) for name, tensor in weights)
        return self.checkpoint_map.load(self, weights)

    def required_parameters(self) -> set[str]:
        return self.checkpoint_map.required()


class ClipTowerModel(ClipModel):
    """``CLIPVisionModel`` / ``CLIPTextModel``: one tower alone, no projection; the embedding
    is transformers' ``pooler_output`` in the tower's width (an image: the class token after
    the post-LayerNorm; a text: its EOS row after the final LayerNorm). Vision encoders of
    larger models (LLaVA's) and text encoders of diffusion models ship as such folders."""

    def _embed_dim(
        self, config: dict[str, Any], text: dict[str, Any] | None, vision: dict[str, Any] | None
    ) -> int:
        tower = text if text is not None else vision
        assert tower is not None
        return int(tower["hidden_size"])

    def _build_heads(self, text: dict[str, Any] | None, vision: dict[str, Any] | None) -> None:
        self.text_projection = None
        self.visual_projection = None

    def _slots(self, text: dict[str, Any] | None, vision: dict[str, Any] | None) -> dict[str, Slot]:
        if text is not None:
            return TextTower.slots("text_model.", text["num_hidden_layers"])
        assert vision is not None
        return VisionTower.slots("vision_model.", vision["num_hidden_layers"], True, False)

    def text_embeddings(self, hidden: Tensor, rows: list[int]) -> Tensor:
        return hidden[rows]  # [len(rows), hidden]

    def image_embeddings(self, hidden: Tensor) -> Tensor:
        assert self.vision_model is not None
        return self.vision_model.post_layernorm(hidden[:, 0])  # [num_images, hidden]


def _tower_name(name: str, prefix: str) -> str:
    """A one-tower checkpoint's tensor name under its tower's ``prefix`` (CLIP's projections,
    outside the tower, aside)."""
    if name.startswith((prefix, "text_projection.", "visual_projection.")):
        return name
    return prefix + name


def _pad_texts(ids: Tensor, lens: list[int], pad_to: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Each text's ids followed by ``pad_id`` up to ``pad_to`` tokens, and their positions."""
    padded = torch.full((len(lens), pad_to), pad_id, dtype=ids.dtype, device=ids.device)
    for i, text in enumerate(torch.split(ids, lens)):
        padded[i, : len(text)] = text
    positions = torch.arange(pad_to, device=ids.device).repeat(len(lens))
    return padded.view(-1), positions
