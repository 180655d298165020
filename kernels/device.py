"""Facts about the device a launcher sizes its grid for."""

from __future__ import annotations

import torch


def num_sms(device: torch.device, *, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``off_gpu`` stands in under the CPU interpreter
    (a launcher's choice: enough programs to exercise its split or persistent loop at small shapes)."""
    if device.type != "cuda":
        return off_gpu
    return torch.cuda.get_device_properties(device).multi_processor_count


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device. A pageable copy (``.to(cuda)``)
    synchronises the stream, i.e. waits for every step already queued: with async scheduling that
    is the step in flight, which then cannot overlap the host's planning. A pinned copy is only
    enqueued; the caching host allocator keeps the pinned block until the copy has run."""
    device = torch.device(device)
    if device.type != "cuda" or host.device.type != "cpu":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def upload_into(buffer: torch.Tensor, host: torch.Tensor) -> None:
    """``buffer.copy_(host)`` for a host tensor, enqueued like ``upload`` (stream-ordered after
    whatever still reads ``buffer``)."""
    if buffer.device.type != "cuda" or host.device.type != "cpu":
        buffer.copy_(host)
    else:
        buffer.copy_(host.pin_memory(), non_blocking=True)
