"""PyLate ColBERT folders as PyLate saves them: a transformers trunk at the root, a Dense
projection without bias (``pylate.models.Dense``) in ``1_Dense``, and the ColBERT settings as
top-level keys of ``config_sentence_transformers.json``. Random weights, the retrieval tests'
tokenizer, the markers either added tokens ("[Q] " / "[D] ", PyLate's default) or vocabulary
tokens ([unused0] / [unused1], as answerai-colbert-small)."""

from __future__ import annotations

import json
import string
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from .encoder_zoo import MODERNBERT
from .seeded import hf_config, random_model
from .vocab import RETRIEVAL_BERT_SPECIALS, VOCAB_SIZE, write_retrieval_tokenizer

HIDDEN = 32
BERT = dict(
    hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
    max_position_embeddings=64, pad_token_id=0, hidden_dropout_prob=0.0,
    attention_probs_dropout_prob=0.0,
)  # fmt: skip
ADDED_MARKERS = ("[Q] ", "[D] ")  # PyLate's default prefixes, added to the vocabulary
VOCAB_MARKERS = ("[unused0]", "[unused1]")


def save_pylate(
    folder: Path,
    trunk: str,
    markers: tuple[str, str],
    *,
    query_length: int,
    document_length: int,
    dim: int,
    attend_to_expansion_tokens: bool = False,
    do_query_expansion: bool = True,
    seed: int = 0,
) -> Path:
    """A PyLate folder over ``trunk`` ("Bert" or "ModernBert") in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    write_retrieval_tokenizer(folder, RETRIEVAL_BERT_SPECIALS, token_types=trunk == "Bert")
    vocab_size = VOCAB_SIZE
    if markers == ADDED_MARKERS:  # PyLate adds its prefixes and resizes the embeddings
        tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(folder)
        tokenizer.add_tokens(list(markers))
        tokenizer.save_pretrained(folder)
        vocab_size = len(tokenizer)
    settings = BERT if trunk == "Bert" else MODERNBERT
    config = hf_config(f"{trunk}Config", settings, {"vocab_size": vocab_size})
    model = random_model(f"{trunk}Model", config, seed)
    model.save_pretrained(folder)
    torch.manual_seed(seed + 1)
    dense = folder / "1_Dense"
    dense.mkdir()
    weight = torch.randn(dim, HIDDEN) * HIDDEN**-0.5
    save_file({"linear.weight": weight}, dense / "model.safetensors")
    dense_config = {
        "in_features": HIDDEN,
        "out_features": dim,
        "bias": False,
        "activation_function": "torch.nn.modules.linear.Identity",
        "use_residual": False,
    }
    (dense / "config.json").write_text(json.dumps(dense_config))
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Dense", "type": "pylate.models.Dense.Dense"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": document_length, "do_lower_case": False})
    )
    settings_json = {
        "prompts": {},
        "default_prompt_name": None,
        "similarity_fn_name": "MaxSim",
        "query_prefix": markers[0],
        "document_prefix": markers[1],
        "query_length": query_length,
        "document_length": document_length,
        "attend_to_expansion_tokens": attend_to_expansion_tokens,
        "skiplist_words": list(string.punctuation),
        "do_query_expansion": do_query_expansion,
        "model_type": "ColBERT",
    }
    (folder / "config_sentence_transformers.json").write_text(json.dumps(settings_json))
    return folder
