"""PyLate ColBERT folders (sentence-transformers ``MultiVectorEncoder`` loads them too:
ModernColBERT, GTE-ModernColBERT, answerai-colbert-small ...): a transformers trunk (BERT or
ModernBERT) at the folder's root, then a Dense projection without bias or activation, then
token vectors L2-normalized; the ColBERT settings are top-level keys of
``config_sentence_transformers.json`` (``ColBERTSettings.from_pylate``).

``registry.pylate_architecture`` names such a folder ``PyLate<Trunk>``. The trunk classes here
add ColBERT's marks (``ColBERTMarks``: the query's [MASK] expansion hidden from attention, the
documents' skiplist rows zeroed); the Dense projection and normalization are the embedding
pooler's (the folder's sentence-transformers Dense, in fp32), and queries and documents are
formatted by ``ColBERTPrompts`` as for colbert-ai folders. A zeroed row stays zero through a
Dense without bias, which ``colbert.pylate_dense_dim`` makes sure of at load.
"""

from __future__ import annotations

from cenote.config import ModelConfig
from cenote.models.bert import BertModel
from cenote.models.colbert import ColBERTMarks
from cenote.models.modernbert import ModernBertModel


class PyLateBertModel(ColBERTMarks, BertModel):
    """``forward(input_ids, positions, token_type_ids) -> [num_tokens, hidden]``: BERT with
    ColBERT's marks; the pooler projects and normalizes."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self._init_marks(model_config)


class PyLateModernBertModel(ColBERTMarks, ModernBertModel):
    """``forward(input_ids, positions) -> [num_tokens, hidden]``: ModernBERT with ColBERT's
    marks (the expansion mask joins the local window); the pooler projects and normalizes."""

    def __init__(self, model_config: ModelConfig) -> None:
        super().__init__(model_config)
        self._init_marks(model_config)
