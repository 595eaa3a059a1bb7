"""Tiny Jina v3 folders (jinaai/jina-embeddings-v3 as the Hub ships it: ``XLMRobertaLoRA``,
remote-code weight names, per-task LoRA factors as torch parametrizations) and their references.

The trunk is transformers' native ``JinaEmbeddingsV3Model`` with seeded random weights. The
folder holds its weights under the remote code's names (``roberta.encoder.layers.N.mixer.Wqkv``,
``emb_ln``, ``norm1`` ...; every linear and embedding as ``parametrizations.weight.original``)
plus random ``lora_A`` / ``lora_B`` stacked by task in the remote code's layout. The references
load the same tensors back through transformers' own conversion mapping
(``conversion_mapping.py`` "jina_embeddings_v3"), from a plain copy of the folder: the base
weights as they are, or with one task's factors merged in plain torch (``W + s B_t A_t``;
embeddings ``E + s A_t B_t``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

from .seeded import perturb
from .vocab import ROBERTA_SPECIALS, VOCAB_SIZE, write_tokenizer

TASKS = ["retrieval.query", "retrieval.passage", "separation", "classification", "text-matching"]
# words of the tests' tokenizer, so the instruction tokens are real ones
INSTRUCTIONS = {
    "retrieval.query": "query : ",
    "retrieval.passage": "document : ",
    "separation": "",
    "classification": "",
    "text-matching": "",
}
LORA_RANK, LORA_ALPHA = 4, 8
JINA_V3 = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    max_position_embeddings=514,
    type_vocab_size=1,
    layer_norm_eps=1e-5,
    pad_token_id=1,
    bos_token_id=0,
    eos_token_id=2,
    hidden_act="gelu",
    hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)
ROTARY_BASE = 20000.0
_PARAMETRIZED = ("mixer.Wqkv", "mixer.out_proj", "mlp.fc1", "mlp.fc2", "word_embeddings")
_PARAMETRIZED += ("token_type_embeddings",)


def _remote_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory names -> the remote code's (the inverse of its conversion)."""
    out: dict[str, torch.Tensor] = {}
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        if name.startswith("pooler."):
            continue
        if name.startswith("layers."):
            index, rest = name.removeprefix("layers.").split(".", 1)
            layers.setdefault(int(index), {})[rest] = tensor
            continue
        out["roberta." + name.replace("embeddings.LayerNorm", "emb_ln")] = tensor
    renames = {
        "self_attn.o_proj": "mixer.out_proj",
        "post_attention_layernorm": "norm1",
        "post_mlp_layernorm": "norm2",
        "mlp.fc1": "mlp.fc1",
        "mlp.fc2": "mlp.fc2",
    }
    for index, tensors in layers.items():
        prefix = f"roberta.encoder.layers.{index}"
        for kind in ("weight", "bias"):
            qkv = [tensors[f"self_attn.{p}_proj.{kind}"] for p in "qkv"]
            out[f"{prefix}.mixer.Wqkv.{kind}"] = torch.cat(qkv)
            for ours, theirs in renames.items():
                out[f"{prefix}.{theirs}.{kind}"] = tensors[f"{ours}.{kind}"]
    return out


def _parametrize(state: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """Adapted weights renamed ``.parametrizations.weight.original`` with random task factors
    beside them (linear: A [t, r, in], B [t, out, r]; embedding: A [t, rows, r], B [t, r, dim]);
    B is not zero, so a task that is not applied changes the output."""
    generator = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    tasks, r = len(TASKS), LORA_RANK
    for name, tensor in state.items():
        module = name.removesuffix(".weight")
        if not name.endswith(".weight") or not module.endswith(_PARAMETRIZED):
            out[name] = tensor
            continue
        rows, cols = tensor.shape
        prefix = f"{module}.parametrizations.weight"
        out[f"{prefix}.original"] = tensor
        if module.endswith("embeddings"):
            shapes = ((tasks, rows, r), (tasks, r, cols))
        else:
            shapes = ((tasks, r, cols), (tasks, rows, r))
        out[f"{prefix}.0.lora_A"] = torch.randn(shapes[0], generator=generator) * 0.3
        out[f"{prefix}.0.lora_B"] = torch.randn(shapes[1], generator=generator) * 0.3
    return out


def save_jina_v3(folder: Path, seed: int = 0) -> Path:
    """A jina-embeddings-v3-shaped folder: config.json (``XLMRobertaLoRA``), model.safetensors
    in the remote code's layout, tokenizer, and sentence-transformers metadata (mean pooling,
    Normalize, the task instructions as prompts)."""
    torch.manual_seed(seed)
    config = transformers.JinaEmbeddingsV3Config(
        **JINA_V3, rope_parameters={"rope_type": "default", "rope_theta": ROTARY_BASE}
    )
    model = perturb(transformers.JinaEmbeddingsV3Model(config, add_pooling_layer=False))
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(_parametrize(_remote_names(state), seed + 1), folder / "model.safetensors")
    remote_config = {
        **JINA_V3,
        "architectures": ["XLMRobertaLoRA"],
        "model_type": "xlm-roberta",
        "position_embedding_type": "rotary",
        "rotary_emb_base": ROTARY_BASE,
        "lora_adaptations": TASKS,
        "task_instructions": INSTRUCTIONS,
        "lora_rank": LORA_RANK,
        "lora_alpha": LORA_ALPHA,
        "lora_dropout_p": 0.0,
        "load_trained_adapters": True,
        "use_flash_attn": False,
        "torch_dtype": "float32",
    }
    (folder / "config.json").write_text(json.dumps(remote_config))
    write_tokenizer(folder, ROBERTA_SPECIALS)
    modules = [
        {"idx": 0, "name": "transformer", "path": "", "type": "custom_st.Transformer"},
        {
            "idx": 1,
            "name": "pooler",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "normalizer",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    pooling = {"word_embedding_dimension": JINA_V3["hidden_size"], "pooling_mode_mean_tokens": True}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "2_Normalize").mkdir(exist_ok=True)
    st_config = {"prompts": INSTRUCTIONS, "default_prompt_name": None}
    (folder / "config_sentence_transformers.json").write_text(json.dumps(st_config))
    return folder


def reference_model(folder: Path, target: Path, task: str | None = None) -> torch.nn.Module:
    """transformers' ``JinaEmbeddingsV3Model`` over ``folder``'s weights, read through its own
    conversion mapping from a copy in ``target``: the base weights, or with ``task``'s factors
    merged (``W + s B_t A_t``; embeddings ``E + s A_t B_t``)."""
    remote = json.loads((folder / "config.json").read_text())
    scale = remote["lora_alpha"] / remote["lora_rank"]
    state = load_file(folder / "model.safetensors")
    plain: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if ".parametrizations.weight." not in name or not name.endswith(".original"):
            if ".parametrizations." not in name:
                plain[name] = tensor
            continue
        module = name.removesuffix(".parametrizations.weight.original")
        weight = tensor.double()
        if task is not None:
            index = remote["lora_adaptations"].index(task)
            a = state[f"{module}.parametrizations.weight.0.lora_A"][index].double()
            b = state[f"{module}.parametrizations.weight.0.lora_B"][index].double()
            weight = weight + scale * (a @ b if module.endswith("embeddings") else b @ a)
        plain[f"{module}.weight"] = weight.float()
    target.mkdir(parents=True, exist_ok=True)
    save_file(plain, target / "model.safetensors")
    config = transformers.JinaEmbeddingsV3Config(
        **JINA_V3,
        rope_parameters={"rope_type": "default", "rope_theta": remote["rotary_emb_base"]},
    )
    config.save_pretrained(target)
    model = transformers.JinaEmbeddingsV3Model.from_pretrained(target, add_pooling_layer=False)
    return model.float().eval()
