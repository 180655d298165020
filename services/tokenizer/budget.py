"""How a prompt is kept from occupying the tokenizer: a length bound proven from its bytes, and encoding off
the thread that answers health.

Invariants:
- ``max_token_bytes`` is at least the byte length of every token the tokenizer can produce, so a text of B
  bytes encodes to at least ceil(B / max_token_bytes) tokens. A text whose bound alone exceeds the budget
  is refused before it is encoded (`check_bytes`); one whose encoding exceeds it is refused after.
- `EncodePool` encodes with ``encode_batch``, which releases the GIL, on worker threads: the event loop
  (which answers grpc.health.v1 and every other call) is never held by an encoding. Prompts over
  ``SMALL_PROMPT_BYTES`` share ``num_large`` threads and queue behind each other there, so a client sending
  large prompts cannot occupy the lane that short prompts use. The large lane's threads run at a lower CPU
  priority (nice +`LARGE_LANE_NICENESS`), so on a busy machine short prompts and the loop get the cores first.
- Encodings run on the lane's own thread: ``TOKENIZERS_PARALLELISM`` is off in a process that makes a pool
  (otherwise the tokenizer hands a batch to its own thread pool, outside the lanes and their priorities).
"""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokenizers import Tokenizer

# Prompts up to this many bytes use the small lane; anything longer, the large one.
SMALL_PROMPT_BYTES = 16 * 1024
LARGE_LANE_NICENESS = 10  # added to the large lane threads' nice value (Linux: per thread)


def _lower_priority() -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LARGE_LANE_NICENESS)
    except OSError:  # not permitted here: the lane still runs, at the default priority
        pass


def _byte_level_alphabet() -> set[str]:
    """The 256 characters a byte-level BPE vocabulary writes bytes as (GPT-2's bytes_to_unicode)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = set(map(chr, printable)), 0
    for b in range(256):
        if b not in printable:
            chars.add(chr(256 + extra))
            extra += 1
    return chars


def max_token_bytes(tokenizer: Tokenizer) -> int:
    """An upper bound on the bytes of any one token, added and special tokens included. With a byte-level
    decoder a vocabulary character in the byte alphabet is one byte; every other character counts its UTF-8
    length (an over-estimate for markers such as "▁", which only loosens the bound)."""
    byte_level = type(tokenizer.decoder).__name__ == "ByteLevel"
    alphabet = _byte_level_alphabet() if byte_level else set()
    longest = 1
    for token in tokenizer.get_vocab(with_added_tokens=True):
        size = sum(1 if c in alphabet else len(c.encode()) for c in token) if byte_level else len(token.encode())
        longest = max(longest, size)
    return longest


def min_tokens(num_bytes: int, token_bytes: int) -> int:
    return -(-num_bytes // token_bytes)


def check_bytes(num_bytes: int, max_tokens: int | None, token_bytes: int) -> None:
    """ValueError when ``num_bytes`` of text prove more than ``max_tokens`` tokens (None: no budget)."""
    if max_tokens is not None and min_tokens(num_bytes, token_bytes) > max_tokens:
        raise ValueError(
            f"the prompt is {num_bytes} bytes, so at least {min_tokens(num_bytes, token_bytes)} tokens "
            f"(no token is longer than {token_bytes} bytes): over the {max_tokens} tokens the context "
            "leaves for it"
        )


def check_tokens(num_tokens: int, max_tokens: int | None) -> None:
    if max_tokens is not None and num_tokens > max_tokens:
        raise ValueError(f"the prompt is {num_tokens} tokens, over the {max_tokens} tokens the context leaves for it")


def chat_content_bytes(body: dict[str, Any]) -> int:
    """Bytes of the messages' text, every one of which the rendered prompt holds verbatim."""
    total = 0
    for message in body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        parts = content if isinstance(content, list) else [content]
        for part in parts:
            text = part.get("text") if isinstance(part, dict) else part
            total += len(text.encode()) if isinstance(text, str) else 0
    return total


class EncodePool:
    """Encodes texts on worker threads: a small lane and a large lane (see the module's invariants)."""

    def __init__(self, tokenizer: Tokenizer, num_threads: int | None = None) -> None:
        self.tokenizer = tokenizer
        num_threads = num_threads or os.cpu_count() or 2
        self.num_large = max(1, num_threads - 1)  # threads for prompts over SMALL_PROMPT_BYTES
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        self._large = ThreadPoolExecutor(self.num_large, thread_name_prefix="encode-large", initializer=_lower_priority)
        self._small = ThreadPoolExecutor(max(1, num_threads - self.num_large), thread_name_prefix="encode-small")
        self.token_bytes = max_token_bytes(tokenizer)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=True)[0].ids

    async def encode(self, text: str, max_tokens: int | None = None) -> list[int]:
        """The text's ids (special tokens on, no BOS added); ValueError when its bytes prove it over
        ``max_tokens`` tokens. The caller checks the prompt it makes of the ids (`check_tokens` after adding
        BOS), so a refusal counts the prompt's tokens as its usage would."""
        num_bytes = len(text.encode())
        check_bytes(num_bytes, max_tokens, self.token_bytes)
        pool = self._small if num_bytes <= SMALL_PROMPT_BYTES else self._large
        return await asyncio.get_running_loop().run_in_executor(pool, self._encode, text)

    async def run(self, num_bytes: int, fn: Any, *args: Any) -> Any:
        """Runs other tokenizer work (chat rendering) in the lane its input size picks."""
        pool = self._small if num_bytes <= SMALL_PROMPT_BYTES else self._large
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def close(self) -> None:
        self._large.shutdown(wait=False, cancel_futures=True)
        self._small.shutdown(wait=False, cancel_futures=True)
