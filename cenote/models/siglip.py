"""SigLIP (``SiglipModel``, and the one-tower ``SiglipTextModel`` / ``SiglipVisionModel`` folders):
CLIP's towers (``clip.py``) with a bidirectional text tower pooled at its last row through a
linear ``head`` (each text padded to ``max_position_embeddings`` with the pad token, no
attention mask: the ``padding="max_length"`` the model card asks for, as it was trained), and a
vision tower without class token nor pre-LayerNorm whose post-LayerNormed rows are pooled by
multi-head attention from a learned probe (MAP head)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from cenote.models.checkpoint_map import Slot, linear_slots
from cenote.models.clip import ClipModel, TextTower, VisionTower
from cenote.models.layers.activation import get_activation
from cenote.models.layers.norm import LayerNorm


class AttentionPoolingHead(nn.Module):
    """``probe`` attends over an image's rows (``nn.MultiheadAttention``'s packed in-projection
    and out-projection), then ``x + mlp(layernorm(x))``: one vector per image."""

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__()
        hidden = config["hidden_size"]
        self.num_heads = config["num_attention_heads"]
        self.probe = nn.Parameter(torch.empty(1, 1, hidden))
        self.attention = nn.MultiheadAttention(hidden, self.num_heads, batch_first=True)
        self.layernorm = LayerNorm(hidden, eps=config.get("layer_norm_eps", 1e-6))
        self.mlp = nn.ModuleDict(
            {
                "fc1": nn.Linear(hidden, config["intermediate_size"]),
                "fc2": nn.Linear(config["intermediate_size"], hidden),
            }
        )
        self.act = get_activation(config.get("hidden_act", "gelu_pytorch_tanh"))

    def forward(self, hidden: Tensor) -> Tensor:
        """``hidden [num_images, num_tokens, width]`` -> ``[num_images, width]``."""
        num_images, num_tokens, width = hidden.shape
        head_dim = width // self.num_heads
        w_q, w_k, w_v = self.attention.in_proj_weight.chunk(3)
        b_q, b_k, b_v = self.attention.in_proj_bias.chunk(3)
        q = F.linear(self.probe[0], w_q, b_q)  # [1, width]
        k, v = F.linear(hidden, w_k, b_k), F.linear(hidden, w_v, b_v)
        q = q.view(1, self.num_heads, 1, head_dim).expand(num_images, -1, -1, -1)
        k = k.view(num_images, num_tokens, self.num_heads, head_dim).transpose(1, 2)
        v = v.view(num_images, num_tokens, self.num_heads, head_dim).transpose(1, 2)
        attended = F.scaled_dot_product_attention(q, k, v)  # [num_images, heads, 1, head_dim]
        x = self.attention.out_proj(attended.reshape(num_images, width))
        inner = self.act(self.mlp["fc1"](self.layernorm(x)))
        return x + self.mlp["fc2"](inner)  # [num_images, width]


class SiglipModel(ClipModel):
    """See the module docstring; the trunk contract is ``ClipModel``'s."""

    class_token = False
    unused_checkpoint_names = (
        "logit_scale",
        "logit_bias",
        "text_model.embeddings.position_ids",
        "vision_model.embeddings.position_ids",
    )

    def _text_tower(self, config: dict[str, Any]) -> TextTower:
        return TextTower(config, causal=False, pool_last=True, pad=True)

    def _vision_tower(self, config: dict[str, Any]) -> VisionTower:
        if not config.get("vision_use_head", True):
            raise ValueError(
                "SigLIP vision towers without the attention-pooling head are not served"
            )
        return VisionTower(config, class_token=False, patch_bias=True)

    def _embed_dim(
        self, config: dict[str, Any], text: dict[str, Any] | None, vision: dict[str, Any] | None
    ) -> int:
        if text is not None:
            return int(text.get("projection_size") or text["hidden_size"])
        assert vision is not None
        return int(vision["hidden_size"])

    def _build_heads(self, text: dict[str, Any] | None, vision: dict[str, Any] | None) -> None:
        # the heads live inside the towers, under transformers' names
        if text is not None and self.text_model is not None:
            self.text_model.add_module("head", nn.Linear(text["hidden_size"], self.hidden_size))
        if vision is not None and self.vision_model is not None:
            if vision["hidden_size"] != self.hidden_size:
                raise ValueError(
                    f"the vision tower's width {vision['hidden_size']} differs from the text "
                    f"projection's {self.hidden_size}: its embeddings would share no space"
                )
            self.vision_model.add_module("head", AttentionPoolingHead(vision))

    def _slots(self, text: dict[str, Any] | None, vision: dict[str, Any] | None) -> dict[str, Slot]:
        slots: dict[str, Slot] = {}
        if text is not None:
            slots.update(TextTower.slots("text_model.", text["num_hidden_layers"]))
            slots.update(linear_slots("text_model.head", "text_model.head"))
        if vision is not None:
            layers = vision["num_hidden_layers"]
            slots.update(VisionTower.slots("vision_model.", layers, False, True))
            head = "vision_model.head."
            slots[head + "probe"] = Slot(head + "probe")
            for name in ("attention.in_proj_weight", "attention.in_proj_bias"):
                slots[head + name] = Slot(head + name)
            for name in ("attention.out_proj", "layernorm", "mlp.fc1", "mlp.fc2"):
                slots.update(linear_slots(head + name, head + name))
        return slots

    def text_embeddings(self, hidden: Tensor, rows: list[int]) -> Tensor:
        assert self.text_model is not None
        projected: Tensor = self.text_model.get_submodule("head")(hidden[rows])
        return projected

    def image_embeddings(self, hidden: Tensor) -> Tensor:
        assert self.vision_model is not None
        head = self.vision_model.get_submodule("head")
        pooled: Tensor = head(self.vision_model.post_layernorm(hidden))
        return pooled
