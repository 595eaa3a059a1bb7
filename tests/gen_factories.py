"""Test helpers for generation: tiny random decoder folders (Llama / Qwen2 / Qwen3) with a
word-level tokenizer, the real SmolLM2 GGUF, and transformers references.

Everything is seeded and small enough for a 2-core CI box.
"""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
import transformers
from factories import random_prompts as random_ids
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

NUM_THREADS = 2  # the CI box has 2 cores; cenote and transformers use the same count
VOCAB_SIZE = 256
SPECIALS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2
BOS_ID, EOS_ID = 1, 2
FIRST_WORD_ID = len(SPECIALS)
_SMALL = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
)
# family -> (config class, causal-LM class, config overrides)
DECODER_FAMILIES: dict[str, tuple[str, str, dict]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=False)),
}


def write_word_tokenizer(folder: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """``tokenizer.json``: WordLevel over ``<pad> <s> </s> w3 ... w{vocab_size-1}``; text is
    whitespace-split words and decodes back with single spaces."""
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD_ID, vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with " "
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(folder / "tokenizer.json"))


def make_decoder(folder: Path, family: str, seed: int = 0, **overrides) -> torch.nn.Module:
    """Save a seeded random fp32 ``family`` causal LM + tokenizer into ``folder``; returns the
    transformers model. Noise on every parameter makes misplaced weights change the output."""
    config_class, model_class, family_overrides = DECODER_FAMILIES[family]
    config = getattr(transformers, config_class)(**{**_SMALL, **family_overrides, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).float().eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    write_word_tokenizer(folder, config.vocab_size)
    return model


def record_steps(llm) -> list:
    """Instrument the engine's scheduler: the list fills with every SchedulerOutput it produces."""
    steps = []
    scheduler = llm.engine.scheduler
    original = scheduler.schedule

    def schedule():
        output = original()
        steps.append(output)
        return output

    scheduler.schedule = schedule
    return steps


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, free of the decoders' special ids."""
    return random_ids(lengths, seed, low=FIRST_WORD_ID, high=VOCAB_SIZE)


def token_prompts(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": list(p)} for p in prompts]


def make_llm(folder: Path, **kwargs):
    from cenote import LLM

    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("num_threads", NUM_THREADS)
    return LLM(str(folder), **kwargs)


# ---- transformers references -----------------------------------------------------------------


def hf_greedy(model: torch.nn.Module, prompts: list[list[int]], max_new_tokens: int) -> list:
    """transformers ``generate(do_sample=False)`` of each prompt alone, EOS ignored (exactly
    ``max_new_tokens`` new tokens)."""
    torch.set_num_threads(NUM_THREADS)
    results = []
    for prompt in prompts:
        input_ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                min_new_tokens=0,
                eos_token_id=None,
                pad_token_id=0,
                num_beams=1,
            )
        new = out[0, len(prompt) :].tolist()
        assert len(new) == max_new_tokens, "transformers stopped early"
        results.append(new)
    return results


def hf_batched_greedy(model, prompts: list[list[int]], max_new_tokens: int, pad_id: int = 0):
    """transformers batched greedy ``generate`` with left padding, EOS ignored."""
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=pad_id,
            num_beams=1,
        )
    return out[:, width:].tolist()


def hf_log_softmax(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    """fp32 log-softmax of transformers' logits over ``token_ids``: [len, vocab]; row i predicts
    token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


# ---- the real SmolLM2 ------------------------------------------------------------------------


def smollm2_path() -> Path:
    from cenote.models.gguf_loader import find_smollm2_gguf

    try:
        return find_smollm2_gguf()
    except FileNotFoundError as error:
        pytest.skip(str(error))


def smollm2_hf(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """transformers' own loading of the SmolLM2 GGUF (dequantized), in ``dtype``."""
    return (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, torch_dtype=dtype
        )
        .to(dtype)
        .eval()
    )
