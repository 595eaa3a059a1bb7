"""What the loaded model can do: found by the engine core at load time, passed to the edge (the
input processor, the server's routes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# sparse: dot product of sparse (SPLADE) embeddings, as sentence-transformers' SparseEncoder
ScoreType = Literal["cross_encoder", "bi_encoder", "late_interaction", "sparse"]


@dataclass(frozen=True)
class ModelCapabilities:
    """What the loaded model can do, found at load time and passed to the edge."""

    supported_tasks: tuple[str, ...]  # e.g. ("embed", "token_embed")
    embedding_size: int | None  # output size of the embedding head (before matryoshka)
    is_matryoshka: bool  # dimensions may be requested
    eos_token_id: int | None  # ends generation
    num_labels: int | None = None  # columns of the classifier head (vocabulary for an LM head)
    label_names: tuple[str, ...] | None = None  # id2label, in label order
    score_type: ScoreType | None = None  # how score() compares texts
    uses_token_type_ids: bool = False  # segment ids matter (BERT pairs)
    # embed's pooling method when long inputs can be chunked and joined (cenote.engine.chunking);
    # None: embeddings of this model cannot be joined (no embed task, ColBERT, sparse)
    chunkable_pooling: Literal["cls", "mean", "last"] | None = None
    normalizes_embeddings: bool = True  # embed's default normalize
    num_image_tokens: int | None = None  # rows an image prompt takes; None: no images
    image_size: int | None = None  # the vision tower's square (preprocessing default)
    embeds_text: bool = True  # False: an image-only model (CLIP / SigLIP vision tower alone)
