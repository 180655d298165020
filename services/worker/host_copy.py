"""A step's outputs copied to host memory behind the work that made them: async scheduling's read-back.

A ``.tolist()``, ``.item()`` or ``.cpu()`` of a CUDA tensor is a copy on the current stream and a wait
for that stream, i.e. for *everything* queued on it so far. Under async scheduling step N+1 is queued
before step N is read back, so such a read of N's tokens waits for N+1 as well, and the device then
idles while the host updates N and plans N+2: the async loop runs no faster than the synchronous one.
``HostCopy`` queues the device → host copies right after the tensors are made (before the next step is
queued), into pinned host buffers, and records an event behind them; ``get`` waits for that event only,
i.e. for the step that made the tensors, never for the one queued after it.

Invariants:
- The copies are queued on the current stream of the tensors' device when the ``HostCopy`` is made, so
  they follow the work that wrote the tensors and precede anything queued later.
- The host tensors are read only through ``get``, which waits for the copies first.
- On the CPU the copies are plain copies into fresh host tensors: the same path, and a reader never
  holds the step's own tensors (what the tests check).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.sampler_output import SamplerOutput


class HostCopy:
    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        devices = {t.device for t in tensors if t.is_cuda}
        if len(devices) > 1:
            raise ValueError(f"a host copy's tensors are on one device, not {sorted(map(str, devices))}")
        self._host: list[torch.Tensor] = []  # one host tensor per input, same shape and dtype
        for t in tensors:
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            host.copy_(t, non_blocking=t.is_cuda)
            self._host.append(host)
        # Recorded behind the copies on the producing stream; None on the CPU or once waited for.
        self._done: torch.cuda.Event | None = None
        if devices:
            self._done = torch.cuda.Event()
            self._done.record(torch.cuda.current_stream(devices.pop()))

    def get(self) -> list[torch.Tensor]:
        """The host tensors, in the order given, once their copies are done (waits for those copies only)."""
        if self._done is not None:
            self._done.synchronize()
            self._done = None
        return self._host


def sampled_copy(sampled: SamplerOutput) -> HostCopy:
    """A SamplerOutput's five tensors, in its field order (``host_sampled`` rebuilds it)."""
    return HostCopy([sampled.token_ids, sampled.logprobs, sampled.top_token_ids, sampled.top_logprobs, sampled.errors])


def host_sampled(copy: HostCopy) -> SamplerOutput:
    """The SamplerOutput of ``sampled_copy``, on the host (waits for its copies)."""
    token_ids, logprobs, top_token_ids, top_logprobs, errors = copy.get()
    return SamplerOutput(
        token_ids=token_ids, logprobs=logprobs, top_token_ids=top_token_ids, top_logprobs=top_logprobs, errors=errors
    )
