"""Facts about the device a launcher sizes its grid for."""

from __future__ import annotations

import torch


def num_sms(device: torch.device, *, off_gpu: int) -> int:
    """Streaming multiprocessors of a CUDA ``device``; ``off_gpu`` stands in under the CPU interpreter
    (a launcher's choice: enough programs to exercise its split or persistent loop at small shapes)."""
    if device.type != "cuda":
        return off_gpu
    return torch.cuda.get_device_properties(device).multi_processor_count
