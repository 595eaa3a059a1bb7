"""Classifier activations, resolved once from the model's config (nothing is imported from it)."""

from __future__ import annotations

from typing import Any, Literal

import torch

Activation = Literal["softmax", "sigmoid", "identity"]

# sentence-transformers CrossEncoder activation_fn (a torch class path) -> ours
_ST_ACTIVATIONS: dict[str, Activation] = {
    "torch.nn.modules.activation.Sigmoid": "sigmoid",
    "torch.nn.modules.activation.Softmax": "softmax",
    "torch.nn.modules.linear.Identity": "identity",
    "torch.nn.Sigmoid": "sigmoid",
    "torch.nn.Softmax": "softmax",
    "torch.nn.Identity": "identity",
}
_PROBLEM_TYPES: dict[str, Activation] = {
    "single_label_classification": "softmax",
    "multi_label_classification": "sigmoid",
    "regression": "identity",
}


def cross_encoder_activation(
    hf_config: dict[str, Any], st_settings: dict[str, Any] | None = None
) -> Activation | None:
    """The sentence-transformers CrossEncoder ``activation_fn``, when the folder names one:
    config.json's ``sentence_transformers`` section, the pre-v4 key, or
    config_sentence_transformers.json (``st_settings``)."""
    candidates = [
        (hf_config.get("sentence_transformers") or {}).get("activation_fn"),
        hf_config.get("sbert_ce_default_activation_function"),
        (st_settings or {}).get("activation_fn"),
    ]
    for path in candidates:
        if path is None:
            continue
        if path not in _ST_ACTIVATIONS:
            raise ValueError(
                f"unsupported cross-encoder activation_fn {path!r}; supported: "
                f"{', '.join(sorted(_ST_ACTIVATIONS))}"
            )
        return _ST_ACTIVATIONS[path]
    return None


def classifier_activation(
    hf_config: dict[str, Any], num_labels: int, st_settings: dict[str, Any] | None = None
) -> Activation:
    """CrossEncoder activation_fn, else HF ``problem_type``, else sigmoid for one label and
    softmax for several."""
    from_st = cross_encoder_activation(hf_config, st_settings)
    if from_st is not None:
        return from_st
    problem_type = hf_config.get("problem_type")
    if problem_type is not None:
        if problem_type not in _PROBLEM_TYPES:
            raise ValueError(
                f"unknown problem_type {problem_type!r}; expected one of {sorted(_PROBLEM_TYPES)}"
            )
        return _PROBLEM_TYPES[problem_type]
    return "sigmoid" if num_labels == 1 else "softmax"


def activate(scores: torch.Tensor, activation: Activation) -> torch.Tensor:
    """``scores [..., num_labels]`` fp32 -> probabilities (or the scores, for identity)."""
    if activation == "softmax":
        return scores.softmax(dim=-1)
    if activation == "sigmoid":
        return scores.sigmoid()
    return scores
