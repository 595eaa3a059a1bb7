"""Structured outputs inside the engine core: grammars compiled off the step loop, one matcher
per request advanced by its accepted tokens, and the token bitmask of a step's rows.

The compiler thread builds llguidance's tokenizer (once, from the model's own fast tokenizer,
GGUF vocabularies included) and each new grammar; a request waits outside the scheduler until
its matcher is ready, so a new schema never stalls the running batch. Compiled grammars are
cached by their text: a repeated schema costs a matcher copy.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from threading import Lock

import numpy as np
import torch
from llguidance import LLMatcher, LLTokenizer

from cenote.config import ModelConfig
from cenote.models.tokenizer import load_tokenizer
from cenote.structured.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

_CACHED_GRAMMARS = 128  # compiled grammars kept for reuse, least recently used dropped


class RequestGrammar:
    """One request's matcher: ready once compiled; advanced by each token the request accepts."""

    def __init__(
        self,
        future: Future[LLMatcher],
        compiler: GrammarCompiler,
        start_after: list[int] | None = None,
    ) -> None:
        self._future = future
        self._matcher: LLMatcher | None = None
        self._compiler = compiler
        self._start_after = start_after  # None once the constraint is on
        self._recent: list[int] = []  # the last tokens, while waiting for start_after

    @property
    def active(self) -> bool:
        """Whether the constraint is on: from the first token, or once ``start_after`` ended
        the output (until then no mask applies and no token is consumed)."""
        return self._start_after is None

    @property
    def vocab_size(self) -> int:
        """llguidance's vocabulary (once ready): the width of the matcher's bitmask rows."""
        return self._compiler.tokenizer().vocab_size

    @property
    def ready(self) -> bool:
        return self._future.done()

    @property
    def future(self) -> Future[LLMatcher]:
        return self._future

    def error(self) -> str | None:
        """Why the grammar did not compile (once ready), else None."""
        exception = self._future.exception()
        if exception is not None:
            return str(exception)
        error = self.matcher.get_error()
        return error or None

    @property
    def matcher(self) -> LLMatcher:
        if self._matcher is None:
            self._matcher = self._future.result()
        return self._matcher

    def accept(self, token_ids: list[int]) -> bool:
        """Advance over ``token_ids``; False if the grammar refused one (its state is an error)."""
        for i, token_id in enumerate(token_ids):
            if self._start_after is None:  # the tokens after it are the constrained ones
                return self.matcher.consume_tokens(token_ids[i:])
            self._recent = [*self._recent, token_id][-len(self._start_after) :]
            if self._recent == self._start_after:
                self._start_after = None
        return True

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and accepts nothing more (EOS included)."""
        return self.active and self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles requests' grammars for one model on a background thread; fills bitmasks."""

    def __init__(
        self, model_config: ModelConfig, vocab_size: int, eos_token_id: int | list[int] | None
    ) -> None:
        self._model_config = model_config
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cenote-grammar")
        self._tokenizer: LLTokenizer | None = None
        self._cache: OrderedDict[str, LLMatcher] = OrderedDict()
        self._lock = Lock()  # the cache is read by the compiler thread and the step loop

    def tokenizer(self) -> LLTokenizer:
        """llguidance's view of the model's tokenizer, built on first use (about a second)."""
        if self._tokenizer is None:
            tokenizer = load_tokenizer(self._model_config)
            # the logits' width, or the tokenizer's when it has more (added tokens past it)
            n_vocab = max(self._vocab_size, tokenizer.get_vocab_size(with_added_tokens=True))
            self._tokenizer = LLTokenizer(
                tokenizer.to_str(), n_vocab=n_vocab, eos_token=self._eos_token_id
            )
        return self._tokenizer

    def submit(self, params: StructuredOutputsParams) -> RequestGrammar:
        future = self._executor.submit(self._compile, params.to_grammar())
        return RequestGrammar(future, self, params.start_after_token_ids)

    def _compile(self, grammar: str) -> LLMatcher:
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                return template.deep_copy()
        matcher = LLMatcher(self.tokenizer(), grammar, log_level=0)
        error = matcher.get_error()
        if error:
            raise ValueError(f"structured outputs: the grammar does not compile: {error}")
        with self._lock:
            self._cache[grammar] = matcher.deep_copy()
            if len(self._cache) > _CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return matcher

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def allowed_tokens(grammars: list[RequestGrammar]) -> torch.Tensor:
    """[len(grammars), words] int32: each grammar's bitmask of the tokens it allows next (bit
    ``t % 32`` of word ``t // 32``; llguidance's layout). The rows are computed one after the
    other on this thread: llguidance's thread pool (``LLExecutor``) keeps its threads spinning
    after a step, and on a CPU the model's own threads need those cores (docs/performance.md,
    structured outputs)."""
    words = (max(g.vocab_size for g in grammars) + 31) // 32
    bits = np.zeros((len(grammars), words), dtype=np.int32)
    address, row_bytes = bits.ctypes.data, words * 4
    for row, grammar in enumerate(grammars):
        grammar.matcher.unsafe_compute_mask_ptr(address + row * row_bytes, row_bytes)
    return torch.from_numpy(bits)
