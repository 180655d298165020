"""A compile manifest's key (services/worker/compile_manifest.py): what picks its variants and what makes them valid,
described as JSON in the manifest's ``key`` file and hashed into its directory's name."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

KEY_FILE = "key"
"""A manifest's description of its key (``describe_key``'s JSON); not an entry (entries end in ``.json``)."""


def versions() -> dict[str, str]:
    """The versions a compiled variant is valid for, as a manifest's key holds them."""
    import torch
    import triton

    return {"triton": triton.__version__, "torch": torch.__version__}


def describe_key(description: Mapping[str, object], device: str) -> str:
    """What a manifest's key hashes, as JSON: ``{"picks": description, "valid": {versions, device, its name and
    capability (on CUDA)}}`` (``description``: JSON-able, any value else by ``str``)."""
    import torch

    validity: dict[str, object] = {**versions(), "device": device}
    if device.startswith("cuda") and torch.cuda.is_available():
        index = torch.device(device).index or 0
        validity["device_name"] = torch.cuda.get_device_name(index)
        validity["capability"] = list(torch.cuda.get_device_capability(index))
    return json.dumps({"picks": description, "valid": validity}, sort_keys=True, default=str)


def manifest_key(description: Mapping[str, object], device: str) -> str:
    """The manifest's key: a hash of ``describe_key``."""
    return key_of(describe_key(description, device))


def key_of(described: str) -> str:
    """The key (a manifest's directory name) of ``describe_key``'s text."""
    return hashlib.sha256(described.encode()).hexdigest()[:24]
