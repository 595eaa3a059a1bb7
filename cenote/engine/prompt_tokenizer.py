"""Texts -> token ids as this model's users expect them: one batched tokenizer call, truncation
as the tokenizer's own (room left for the special tokens), sentence-transformers' instruction
prompt and lower-casing, ColBERT's query / document markers, cross-encoder pairs with segment
ids. The input processor is its one caller; it validates what comes out."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
from tokenizers import Encoding, Tokenizer

from cenote.config import ModelConfig
from cenote.engine.chunking import window_spans
from cenote.errors import InvalidInputError
from cenote.inputs import TextRole
from cenote.models.interfaces import FormatsPrompts, PromptFormat
from cenote.models.registry import load_model_class

# the names a sentence-transformers folder gives a role's prompt, first found wins (as
# sentence-transformers' encode_query / encode_document look them up)
ROLE_PROMPT_NAMES: dict[str, tuple[str, ...]] = {
    "query": ("query",),
    "document": ("document", "passage", "corpus"),
    "classification": ("classification",),
    "clustering": ("clustering",),
}


@dataclass
class TokenizedPrompt:
    prompt: str | None  # the text, when the prompt was text
    prompt_token_ids: list[int]
    token_type_ids: list[int] | None = None  # segment ids (cross-encoder pairs)
    num_instruction_tokens: int = 0  # leading tokens of the prepended instruction prompt
    truncated: bool = False  # tokens were cut (truncation; a pair's document)
    # an image prompt: its preprocessed pixels; prompt_token_ids are placeholders (one per token)
    pixel_values: torch.Tensor | None = None


class PromptTokenizer:
    """The model's tokenizer with its sentence-transformers and ColBERT settings. The shared
    tokenizer is never toggled (no ``enable_truncation``), so threads may share it."""

    def __init__(
        self, model_config: ModelConfig, tokenizer: Tokenizer, uses_token_type_ids: bool
    ) -> None:
        self.tokenizer = tokenizer
        self.uses_token_type_ids = uses_token_type_ids
        st = model_config.st_config
        self.do_lower_case = bool(st and st.do_lower_case)
        self.model_prompts: dict[str, str] = dict(st.prompts) if st is not None else {}
        self.default_prompt = ""
        if st is not None and st.default_prompt_name:
            self.default_prompt = st.prompts.get(st.default_prompt_name, "")
        self.instruction_length = lru_cache(maxsize=64)(self._instruction_length)
        self.prompt_format = _prompt_format(model_config, tokenizer)  # None: texts as they are

    def instruction(self, prompt_name: str | None, prompt: str | None) -> str:
        """The instruction prompt a pooled text gets, as sentence-transformers' ``encode``
        picks it: ``prompt`` as given, else the model's prompt named ``prompt_name``, else the
        model's default prompt."""
        if prompt is not None:
            return prompt
        if prompt_name is None:
            return self.default_prompt
        if prompt_name not in self.model_prompts:
            known = ", ".join(repr(name) for name in self.model_prompts) or "none"
            raise InvalidInputError(
                f"prompt_name {prompt_name!r} is not one of the model's prompts ({known}; "
                "config_sentence_transformers.json); pass prompt for a literal instruction"
            )
        return self.model_prompts[prompt_name]

    def role_prompt_name(self, role: str, *more: str) -> str | None:
        """The model's prompt for ``role`` (``ROLE_PROMPT_NAMES``, then ``more`` names), None
        when it has none."""
        names = (*ROLE_PROMPT_NAMES[role], *more)
        return next((n for n in names if n in self.model_prompts), None)

    def texts(
        self,
        texts: list[str],
        max_length: int | None,
        side: str,
        add_special_tokens: bool,
        instruction: str | None,
        role: TextRole = "document",
    ) -> list[TokenizedPrompt]:
        """Token ids of ``texts``, at most ``max_length`` each. Pooled texts (``instruction``
        not None: see ``instruction()``) get the instruction prompt in front and, on a ColBERT
        model, the marker of ``role``."""
        is_pooling = instruction is not None
        layout = self.prompt_format if is_pooling else None
        if layout is not None:  # the marker after [CLS] takes one of the tokens
            limit = layout.max_length(role) - 1
            max_length = limit if max_length is None else min(max_length - 1, limit)
        if instruction is not None:
            texts_in = [instruction + t for t in texts]
            if self.do_lower_case:
                texts_in = [t.lower() for t in texts_in]
        else:
            texts_in = texts
        encoded = self._encode(texts_in, max_length, side, add_special_tokens)
        num_instruction = self.instruction_length(instruction) if instruction else 0
        results = []
        for text, (encoding, truncated) in zip(texts, encoded, strict=True):
            ids = list(encoding.ids)
            if layout is not None:
                ids = layout.format(ids, role)
            results.append(TokenizedPrompt(text, ids, None, num_instruction, truncated))
        return results

    def _encode(
        self, texts: list[str], max_length: int | None, side: str, add_special_tokens: bool
    ) -> list[tuple[Encoding, bool]]:
        """Each text's encoding and whether it was cut to ``max_length``."""
        if max_length is None:
            encoded = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
            return [(e, False) for e in encoded]
        # Truncate as the tokenizer's own truncation does (the text is cut to leave room for the
        # special tokens), without toggling the shared tokenizer: safe from several threads.
        # Texts are encoded whole first (special tokens and all: the same ids as post-processing
        # the bare encoding); only those past ``max_length`` are encoded bare again, cut and
        # post-processed (8,192 short texts: 0.20 s of post_process calls a pass saved).
        room = max_length
        if add_special_tokens:
            room = max(max_length - self.tokenizer.num_special_tokens_to_add(is_pair=False), 0)
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)
        results = [(e, False) for e in encoded]
        too_long = [i for i, e in enumerate(encoded) if len(e.ids) > max_length]
        if not too_long:
            return results
        bare = self.tokenizer.encode_batch([texts[i] for i in too_long], add_special_tokens=False)
        for i, encoding in zip(too_long, bare, strict=True):
            truncated = len(encoding.ids) > room
            if truncated:
                encoding.truncate(room, direction=side)
            results[i] = (
                self.tokenizer.post_process(encoding, None, add_special_tokens),
                truncated,
            )
        return results

    def pairs(
        self,
        pairs: list[tuple[str, str]],
        max_length: int | None,
        max_tokens_per_doc: int | None,
        indices: list[int],
    ) -> list[TokenizedPrompt]:
        """Cross-encoder inputs: ``[CLS] query [SEP] document [SEP]`` with segment ids. The
        document is cut first (``max_tokens_per_doc``, then to fit ``max_length``); a query
        that alone exceeds the limit is an error naming its pair (``indices``)."""
        num_special = self.tokenizer.num_special_tokens_to_add(is_pair=True)
        queries = self.tokenizer.encode_batch([q for q, _ in pairs], add_special_tokens=False)
        documents = self.tokenizer.encode_batch([d for _, d in pairs], add_special_tokens=False)
        results = []
        for index, query, document in zip(indices, queries, documents, strict=True):
            doc_budget = len(document.ids)
            if max_tokens_per_doc is not None:
                doc_budget = min(doc_budget, max_tokens_per_doc)
            if max_length is not None:
                room = max_length - num_special - len(query.ids)
                if room < 0:
                    raise InvalidInputError(
                        f"pair {index}: the query has {len(query.ids)} tokens (+{num_special} "
                        f"special), more than truncate_prompt_tokens={max_length}; documents are "
                        "cut, queries are not"
                    )
                doc_budget = min(doc_budget, room)
            truncated = doc_budget < len(document.ids)
            if truncated:
                document.truncate(doc_budget)
            pair = self.tokenizer.post_process(query, document, add_special_tokens=True)
            token_types = list(pair.type_ids) if self.uses_token_type_ids else None
            results.append(TokenizedPrompt(None, list(pair.ids), token_types, truncated=truncated))
        return results

    def pair_windows(
        self,
        pairs: list[tuple[str, str]],
        max_length: int,
        max_tokens_per_doc: int | None,
        overlap: int,
        indices: list[int],
    ) -> list[list[TokenizedPrompt]]:
        """Cross-encoder inputs for chunk-and-max reranking: per pair, its document (cut to
        ``max_tokens_per_doc`` first) in windows that overlap by ``overlap`` tokens, each as
        ``[CLS] query [SEP] window [SEP]`` within ``max_length``; the query whole in each."""
        num_special = self.tokenizer.num_special_tokens_to_add(is_pair=True)
        queries = self.tokenizer.encode_batch([q for q, _ in pairs], add_special_tokens=False)
        documents = self.tokenizer.encode_batch([d for _, d in pairs], add_special_tokens=False)
        results = []
        for index, query, document in zip(indices, queries, documents, strict=True):
            room = max_length - num_special - len(query.ids)
            if room <= overlap:
                raise InvalidInputError(
                    f"pair {index}: the query has {len(query.ids)} tokens (+{num_special} "
                    f"special), leaving {max(room, 0)} of max_model_len={max_length} for each "
                    f"document window, which must be more than chunk_overlap={overlap}"
                )
            length = len(document.ids)
            if max_tokens_per_doc is not None:
                length = min(length, max_tokens_per_doc)
            windows = []
            for start, end in window_spans(length, room, overlap):
                window = Encoding.merge([document], growing_offsets=False)  # a copy to cut
                window.truncate(end, direction="right")
                window.truncate(end - start, direction="left")
                pair = self.tokenizer.post_process(query, window, add_special_tokens=True)
                token_types = list(pair.type_ids) if self.uses_token_type_ids else None
                truncated = end < len(document.ids)
                windows.append(TokenizedPrompt(None, list(pair.ids), token_types, 0, truncated))
            results.append(windows)
        return results

    def cut_texts(self, texts: list[str], max_tokens: int) -> list[str]:
        """Each text cut to its first ``max_tokens`` tokens (no special tokens); a text that
        fits is returned as it is (the same object)."""
        encoded = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        return [
            text if len(e.ids) <= max_tokens else self.tokenizer.decode(e.ids[:max_tokens])
            for text, e in zip(texts, encoded, strict=True)
        ]

    @cached_property
    def special_frame(self) -> tuple[list[int], list[int]]:
        """The special tokens the tokenizer puts before and after a single text."""
        bare = self.tokenizer.encode("a", add_special_tokens=False).ids
        full = self.tokenizer.encode("a").ids
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start], full[start + len(bare) :]
        return [], []

    def _instruction_length(self, prompt: str) -> int:
        """Tokens of an instruction prompt as sentence-transformers counts them: the prompt
        tokenized alone, special tokens included, less a trailing special token."""
        prompt = prompt.lower() if self.do_lower_case else prompt
        encoding = self.tokenizer.encode(prompt)
        special = {i for i, t in self.tokenizer.get_added_tokens_decoder().items() if t.special}
        length = len(encoding.ids)
        if length and (encoding.special_tokens_mask[-1] or encoding.ids[-1] in special):
            length -= 1
        return length


def _prompt_format(model_config: ModelConfig, tokenizer: Tokenizer) -> PromptFormat | None:
    """The model class's layout of texts by role (``FormatsPrompts``: ColBERT); None for the
    models that take texts as they are."""
    model_class = load_model_class(model_config.architecture)
    if not issubclass(model_class, FormatsPrompts):
        return None
    return model_class.prompt_format(model_config, tokenizer)
