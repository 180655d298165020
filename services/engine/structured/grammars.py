"""Grammars compiled against the model's vocabulary off the step thread, cached by their text, and the matcher
each constrained request walks.

A compile runs on this object's own thread; the engine holds the request behind the scheduler's readiness gate
(``schedulable=False``) until its future is done, so a slow compile never stalls the batch. One compile per
distinct constraint text: later requests with the same text share its future.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from services.engine.structured.constraint import Constraint

COMPILE_TIMEOUT_S = 30.0
"""A grammar still compiling after this long is refused (its request ends with an error naming it)."""


MARKUP_TOKENS = frozenset({"</think>", "｜DSML｜"})
"""Added tokens that structural tags write as text, so their matchers must allow them: the end of reasoning and
DeepSeek-V4.1's DSML markup (services/engine/structured/tool_calls.py), each one token as the model writes it."""


def tokenizer_vocab(tokenizer, vocab_size: int, markup: bool = False) -> list[str]:
    """The model's token strings by id (``tokenizers.Tokenizer``) as xgrammar's ``TokenizerInfo`` takes them, with
    "" for ids the tokenizer lacks and for its added tokens (``<｜User｜>``, ``<｜begin▁of▁sentence｜>``, image
    placeholders, ``</think>``, ...), but, with ``markup``, ``MARKUP_TOKENS``. xgrammar treats a token whose string
    is "" as special: no grammar state allows it, so a constrained output never holds one (inside a JSON string, a
    raw tool-call parameter or the reasoning), though the same text spelt with ordinary tokens stays possible where
    the grammar allows that text. The end token stays allowed where a grammar may end (the compiler's stop token)."""
    vocab = [""] * vocab_size
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            vocab[token_id] = token
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if token_id < vocab_size and not (markup and added.content in MARKUP_TOKENS):
            vocab[token_id] = ""
    return vocab


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int, timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """``tokenizer``: the model's byte-level BPE ``tokenizers.Tokenizer``. The vocabulary's xgrammar forms are
        built on the first compile that needs each (an engine that never sees a constraint never pays for one): one
        without any added token, for JSON, regexes, choices and EBNF grammars, and one with the markup tokens, for
        structural tags (``tokenizer_vocab``)."""
        self.vocab_size = vocab_size
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self._eos_token_id = eos_token_id
        # xgrammar's GrammarCompiler by whether its vocabulary keeps the markup tokens, made by the compile thread
        self._compilers: dict[bool, object] = {}
        self._batch = None  # xgrammar's BatchGrammarMatcher (the step thread's parallel mask fill), made on first use
        # One thread: compiles queue behind each other, never beside the step thread's work on more cores.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}  # by Constraint.key; a failed compile is dropped, so it is retried

    def compile(self, constraint: Constraint) -> Future:
        """The compiled grammar's future (shared by every request with the same constraint text). The grammar
        is parsed here, on the caller's thread: ValueError for a bad schema, regex or grammar."""
        with self._lock:
            future = self._futures.get(constraint.key)
            if future is not None:
                return future
        grammar = constraint.grammar()
        with self._lock:
            future = self._futures.get(constraint.key)
            if future is None:
                future = self._pool.submit(self._compile, grammar, constraint.kind == "structural_tag")
                self._futures[constraint.key] = future
        return future

    def _compile(self, grammar, markup: bool):
        """On the compile thread: the vocabulary's token-mask tables for ``grammar`` (``markup``: a structural tag)."""
        import xgrammar as xgr

        compiler = self._compilers.get(markup)
        if compiler is None:
            info = xgr.TokenizerInfo(
                tokenizer_vocab(self._tokenizer, self.vocab_size, markup),
                xgr.VocabType.BYTE_LEVEL,
                vocab_size=self.vocab_size,
                stop_token_ids=[self._eos_token_id],
            )
            compiler = self._compilers[markup] = xgr.GrammarCompiler(info, max_threads=1)
        return compiler.compile_grammar(grammar)

    def forget(self, constraint: Constraint) -> None:
        """Drops a failed or refused compile from the cache."""
        with self._lock:
            self._futures.pop(constraint.key, None)

    def bitmask(self, num_rows: int) -> torch.Tensor:
        """An all-allowed token bitmask [num_rows, ceil(V / 32)] int32 on the host (bit t of word w: token 32w + t)."""
        return torch.full((num_rows, (self.vocab_size + 31) // 32), -1, dtype=torch.int32)

    def fill(self, matchers: list, mask: torch.Tensor, rows: list[int]) -> None:
        """Each matcher's next-token mask into its row of ``mask`` (``rows[i]`` for ``matchers[i]``), filled in
        parallel on xgrammar's batch matcher's threads (half the host's cores): the same bits as one
        ``fill_next_token_bitmask`` per matcher."""
        import xgrammar as xgr

        if self._batch is None:
            self._batch = xgr.BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask(matchers, mask, rows)

    @staticmethod
    def matcher(compiled):
        """A fresh matcher at the grammar's start (one per request; each choice of n > 1 its own)."""
        import xgrammar as xgr

        return xgr.GrammarMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
