"""Embedding throughput of full-size MPNet, ModernBERT, DeBERTa-v3 and GTE v1.5: cenote vs
sentence-transformers.

No such checkpoint is reachable offline, and a tiny model says nothing about speed, so each is
built at full size from its published config with random weights: all-mpnet-base-v2 (MPNet, 12
layers x 768, relative position buckets), ModernBERT-base (22 layers x 768, global / 128-token
local attention, GeGLU) and deberta-v3-small (6 layers x 768, disentangled attention over 256
log buckets) and gte-base-en-v1.5 (12 layers x 768, rotary, gated MLP; transformers' native
``GteModel``, the weights in the Hub's remote-code layout). Each is saved as a sentence-transformers folder (mean pooling + Normalize) with
all-MiniLM-L6-v2's WordPiece tokenizer (token counts are what matter here); both engines embed
the same corpus (embed_offline's prose) with the same thread count, in fp32 and bf16. Prints the
CPU, tokens/s, the cenote / sentence-transformers ratio per dtype and the min cosine between the
two. ``--clip-images N`` adds a full-size CLIP ViT-B/32 (``clip_images.py``): images/s vs
transformers, preprocessing included.

    flock /tmp/cpu_bench.lock .venv/bin/python -m benchmarks.embed_architectures --num-texts 100
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F

from benchmarks.clip_images import bench_clip
from benchmarks.common import cpu_banner
from benchmarks.embed_offline import make_corpus, run_cenote, run_st

# name -> (transformers config class, model class, config overrides, max_seq_length)
ARCHITECTURES: dict[str, tuple[str, str, dict, int]] = {
    # all-mpnet-base-v2's config.json (MPNetConfig's defaults otherwise)
    "mpnet-base": (
        "MPNetConfig",
        "MPNetModel",
        dict(
            vocab_size=30527,
            max_position_embeddings=514,
            layer_norm_eps=1e-5,
            bos_token_id=0,
            eos_token_id=2,
            pad_token_id=1,
        ),
        384,
    ),
    # ModernBertConfig's defaults are ModernBERT-base
    "modernbert-base": ("ModernBertConfig", "ModernBertModel", {}, 512),
    # microsoft/deberta-v3-small's config.json (mxbai-rerank-xsmall-v1 is its 384-wide sibling)
    "deberta-v3-small": (
        "DebertaV2Config",
        "DebertaV2Model",
        dict(
            vocab_size=128100,
            hidden_size=768,
            num_hidden_layers=6,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=512,
            relative_attention=True,
            position_buckets=256,
            norm_rel_ebd="layer_norm",
            share_att_key=True,
            pos_att_type="p2c|c2p",
            layer_norm_eps=1e-7,
            max_relative_positions=-1,
            position_biased_input=False,
            type_vocab_size=0,
            pad_token_id=0,
        ),
        512,
    ),
    # Alibaba-NLP/gte-base-en-v1.5's config.json (remote-code NewConfig keys as GteConfig's)
    "gte-base-en-v1.5": (
        "GteConfig",
        "GteModel",
        dict(
            vocab_size=30528,
            hidden_size=768,
            num_hidden_layers=12,
            num_attention_heads=12,
            intermediate_size=3072,
            max_position_embeddings=8192,
            type_vocab_size=0,
            layer_norm_eps=1e-12,
            pad_token_id=0,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        512,
    ),
}


def build_folder(name: str, root: Path, seed: int = 0) -> Path:
    """A random-weight sentence-transformers folder of architecture ``name`` under ``root``."""
    import transformers
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from tokenizers import Tokenizer

    from cenote.config import default_model_path

    config_class, model_class, overrides, max_seq_length = ARCHITECTURES[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**overrides)
    model = getattr(transformers, model_class)(config).float().eval()
    trunk = root / f"{name}-trunk"
    model.save_pretrained(trunk)
    tokenizer = Tokenizer.from_file(str(default_model_path() / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        pad_token="[PAD]",
        mask_token="[MASK]",
    )
    fast.save_pretrained(trunk)
    transformer = Transformer(str(trunk), max_seq_length=max_seq_length)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="mean")
    folder = root / name
    SentenceTransformer(modules=[transformer, pooling, Normalize()], device="cpu").save(str(folder))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--architectures", default=",".join(ARCHITECTURES))
    parser.add_argument("--num-texts", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers batch")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--clip-images", type=int, default=0, help="images for CLIP (0: none)")
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from cenote import LLM

    torch.set_num_threads(args.threads)
    texts = make_corpus(args.num_texts)
    print(f"{cpu_banner()}\ntexts={len(texts)} threads={args.threads}")
    header = (
        f"{'model':16} {'dtype':9} {'engine':8} {'tokens':>7} {'seconds':>8} {'tok/s':>8} "
        f"{'ratio':>6} {'min cos':>8}"
    )
    rows = [header, "-" * len(header)]
    with tempfile.TemporaryDirectory(prefix="cenote-arch-bench-") as tmp:
        if args.clip_images:
            dtypes = args.dtypes.split(",")
            rows += bench_clip(Path(tmp), args.clip_images, args.threads, dtypes, args.batch_size)
        for name in filter(None, args.architectures.split(",")):
            folder = build_folder(name, Path(tmp))
            st = SentenceTransformer(str(folder), device="cpu").eval()
            num_tokens = int(st.preprocess(texts)["attention_mask"].sum())
            for dtype_name in args.dtypes.split(","):
                st = SentenceTransformer(str(folder), device="cpu").eval()
                st = st.to(getattr(torch, dtype_name))
                torch.set_num_threads(args.threads)
                theirs = run_st(st, texts, args.batch_size)
                del st
                llm = LLM(str(folder), dtype=dtype_name, num_threads=args.threads)
                ours = run_cenote(llm, texts)
                del llm
                cosine = F.cosine_similarity(ours.embeddings, theirs.embeddings, dim=-1)
                ratio = theirs.seconds / ours.seconds
                for engine, result, extra in (
                    ("st", theirs, ""),
                    ("cenote", ours, f"{ratio:6.2f} {float(cosine.min()):8.6f}"),
                ):
                    rows.append(
                        f"{name:16} {dtype_name:9} {engine:8} {num_tokens:7d} "
                        f"{result.seconds:8.2f} {num_tokens / result.seconds:8.0f} {extra}"
                    )
                print(rows[-2], rows[-1], sep="\n", flush=True)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
