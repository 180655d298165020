"""The penalties' state: per request, how often each token occurs in its output so far, and which tokens its
prompt holds, on the sampler's device.

Layout: ``output`` int32 [S, V] (occurrences in the output) and ``prompt`` bool [S, V] (in the prompt), one row
(a *slot*) per request whose sampling reads them (``SamplingRow.history``). The engine hands out the slots and
gives the prompt with a request's first sampled row (``SamplingRow.history_prompt``); the worker ``open``s the slot
before that step's sampler runs and ``record``s every sampled row's token right after it, both queued on the
device, so under async scheduling step N + 1's sampler (queued behind step N's record) reads counts that hold
step N's tokens without any host read. The tensors are the sampler's inputs, never copied per step (a captured
graph reads them in place); ``S`` grows (by doubling) when the engine names a slot past it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.device import upload


class TokenCounts:
    def __init__(self, vocab_size: int, device: torch.device | str, num_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.output = torch.zeros(num_slots, vocab_size, dtype=torch.int32, device=self.device)
        self.prompt = torch.zeros(num_slots, vocab_size, dtype=torch.bool, device=self.device)

    @property
    def num_slots(self) -> int:
        return self.output.shape[0]

    def _reserve(self, slot: int) -> None:
        if slot < self.num_slots:
            return
        size = self.num_slots
        while size <= slot:
            size *= 2
        grow = size - self.num_slots
        self.output = torch.cat([self.output, self.output.new_zeros(grow, self.vocab_size)])
        self.prompt = torch.cat([self.prompt, self.prompt.new_zeros(grow, self.vocab_size)])

    def open(self, slot: int, prompt_token_ids: Sequence[int]) -> None:
        """Slot ``slot`` starts a request: no output tokens yet, the prompt's tokens marked."""
        if slot < 0:
            raise ValueError(f"a token-count slot is >= 0, got {slot}")
        self._reserve(slot)
        self.output[slot].zero_()
        self.prompt[slot].zero_()
        if prompt_token_ids:
            ids = upload(torch.tensor(list(prompt_token_ids), dtype=torch.int64), self.device)
            self.prompt[slot].index_fill_(0, ids, True)

    def record(self, slots: Sequence[int | None], token_ids: torch.Tensor) -> None:
        """Counts ``token_ids`` [R] (the step's sampled rows, on the device) into their rows' slots (None: a row
        without one). Device ops only; the slot list is the host's."""
        rows = [i for i, s in enumerate(slots) if s is not None]
        if not rows:
            return
        self._reserve(max(slots[i] for i in rows))
        device = token_ids.device
        index = upload(torch.tensor(rows, dtype=torch.int64), device)
        targets = upload(torch.tensor([slots[i] for i in rows], dtype=torch.int64), device)
        tokens = token_ids[index].to(torch.int64)
        self.output.index_put_((targets, tokens), torch.ones_like(tokens, dtype=torch.int32), accumulate=True)
