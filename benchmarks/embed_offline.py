"""Offline embedding throughput: cenote ``LLM.embed`` vs sentence-transformers, side by side.

Same model (all-MiniLM-L6-v2 by default), same deterministic corpus, same torch thread count,
fp32 and bf16. Prints sentences/s, real tokens/s (non-padding tokens after truncation to the
model's max_seq_length), the cenote/ST ratio per dtype and the min cosine between the two.

    .venv/bin/python -m benchmarks.embed_offline --num-texts 300
"""

from __future__ import annotations

import argparse
import os
import random
import time
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
import torch.nn.functional as F

# Public-domain prose (19th century novels), sliced into items of 10-300 words.
PROSE = """
It is a truth universally acknowledged, that a single man in possession of a good fortune, must
be in want of a wife. However little known the feelings or views of such a man may be on his
first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding
families, that he is considered the rightful property of some one or other of their daughters.
Call me Ishmael. Some years ago, never mind how long precisely, having little or no money in my
purse, and nothing particular to interest me on shore, I thought I would sail about a little and
see the watery part of the world. It is a way I have of driving off the spleen and regulating the
circulation. Whenever I find myself growing grim about the mouth; whenever it is a damp, drizzly
November in my soul; whenever I find myself involuntarily pausing before coffin warehouses, and
bringing up the rear of every funeral I meet; then, I account it high time to get to sea as soon
as I can. It was the best of times, it was the worst of times, it was the age of wisdom, it was
the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the
season of Light, it was the season of Darkness, it was the spring of hope, it was the winter of
despair, we had everything before us, we had nothing before us, we were all going direct to
Heaven, we were all going direct the other way. Alice was beginning to get very tired of sitting
by her sister on the bank, and of having nothing to do: once or twice she had peeped into the
book her sister was reading, but it had no pictures or conversations in it, and what is the use
of a book, thought Alice, without pictures or conversations? So she was considering in her own
mind, as well as she could, for the hot day made her feel very sleepy and stupid, whether the
pleasure of making a daisy-chain would be worth the trouble of getting up and picking the
daisies, when suddenly a White Rabbit with pink eyes ran close by her. Happy families are all
alike; every unhappy family is unhappy in its own way. Everything was in confusion in the
Oblonskys' house. The wife had discovered that the husband was carrying on an intrigue with a
French girl, who had been a governess in their family, and she had announced to her husband that
she could not go on living in the same house with him. You will rejoice to hear that no disaster
has accompanied the commencement of an enterprise which you have regarded with such evil
forebodings. I arrived here yesterday, and my first task is to assure my dear sister of my
welfare and increasing confidence in the success of my undertaking. I am already far north of
London, and as I walk in the streets of Petersburgh, I feel a cold northern breeze play upon my
cheeks, which braces my nerves and fills me with delight. In my younger and more vulnerable
years my father gave me some advice that I have been turning over in my mind ever since.
Whenever you feel like criticizing any one, he told me, just remember that all the people in
this world have not had the advantages that you have had. The sun shone, having no alternative,
on the nothing new. Marley was dead, to begin with. There is no doubt whatever about that. The
register of his burial was signed by the clergyman, the clerk, the undertaker, and the chief
mourner. Scrooge signed it: and Scrooge's name was good upon Change, for anything he chose to put
his hand to. Old Marley was as dead as a door-nail.
"""


def make_corpus(num_texts: int, seed: int = 0) -> list[str]:
    """``num_texts`` slices of PROSE, 10-300 words each, starting anywhere (wrapping around)."""
    words = PROSE.split()
    rng = random.Random(seed)
    texts = []
    for _ in range(num_texts):
        start, n = rng.randrange(len(words)), rng.randint(10, 300)
        texts.append(" ".join(words[(start + i) % len(words)] for i in range(n)))
    return texts


@dataclass
class Result:
    seconds: float
    embeddings: torch.Tensor  # [num_texts, dim] fp32


def run_st(model, texts: list[str], batch_size: int) -> Result:
    model.encode(texts[:batch_size], batch_size=batch_size)  # warm-up
    start = time.perf_counter()
    emb = model.encode(texts, batch_size=batch_size, convert_to_tensor=True)
    return Result(time.perf_counter() - start, emb.float())


def run_cenote(llm, texts: list[str]) -> Result:
    llm.embed(texts[:32], truncate_prompt_tokens=-1, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.embed(texts, truncate_prompt_tokens=-1, use_tqdm=False)
    seconds = time.perf_counter() - start
    return Result(seconds, torch.stack([o.outputs.data.float() for o in outputs]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model folder (default: all-MiniLM-L6-v2)")
    parser.add_argument("--num-texts", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32, help="sentence-transformers batch")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from sentence_transformers import SentenceTransformer

    from cenote import LLM
    from cenote.config import default_model_path
    from cenote.platforms import CpuPlatform

    torch.set_num_threads(args.threads)
    path = args.model or str(default_model_path())
    texts = make_corpus(args.num_texts, args.seed)
    st = SentenceTransformer(path, device="cpu").eval()
    mask = st.preprocess(texts)["attention_mask"]  # truncated to max_seq_length, as both run
    num_tokens = int(mask.sum())
    print(
        f"model={path}\ntexts={len(texts)} tokens={num_tokens} (mean {num_tokens / len(texts):.0f},"
        f" max {int(mask.sum(1).max())}) threads={args.threads} st_batch_size={args.batch_size}"
    )
    header = f"{'dtype':9} {'engine':8} {'seconds':>8} {'sent/s':>9} {'tok/s':>10} {'ratio':>6}"
    rows = [header, "-" * len(header)]
    seconds: dict[tuple[str, str], float] = {}
    for dtype_name in args.dtypes.split(","):
        # a fresh fp32 load per dtype: a bf16 round trip would change the fp32 weights
        st = SentenceTransformer(path, device="cpu").eval().to(getattr(torch, dtype_name))
        torch.set_num_threads(args.threads)
        theirs = run_st(st, texts, args.batch_size)
        llm = LLM(path, dtype=dtype_name, num_threads=args.threads)
        ours = run_cenote(llm, texts)
        del llm
        seconds[("st", dtype_name)], seconds[("cenote", dtype_name)] = theirs.seconds, ours.seconds
        ratio = theirs.seconds / ours.seconds
        min_cos = float(F.cosine_similarity(ours.embeddings, theirs.embeddings, dim=-1).min())
        for name, result, extra in (("st", theirs, ""), ("cenote", ours, f"{ratio:6.2f}")):
            rows.append(
                f"{dtype_name:9} {name:8} {result.seconds:8.2f} "
                f"{len(texts) / result.seconds:9.1f} {num_tokens / result.seconds:10.0f} {extra}"
            )
        rows.append(f"{dtype_name:9} min cosine cenote vs st: {min_cos:.6f}")
    # what users get without tuning: cenote's dtype="auto" vs sentence-transformers' fp32
    auto = str(CpuPlatform().default_dtype()).removeprefix("torch.")
    if ("cenote", auto) in seconds and ("st", "float32") in seconds:
        rows.append(
            f"defaults: cenote auto ({auto}) / sentence-transformers float32 = "
            f"{seconds[('st', 'float32')] / seconds[('cenote', auto)]:.2f}x"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
