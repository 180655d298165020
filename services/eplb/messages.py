"""Wire formats of the planner's NATS messages (subjects in `services/subjects.py`).

Load report (engine → planner, binary, little-endian), one per engine rank per step:

    offset  size  field
    0       4     magic b"SKEL"
    4       1     format version (LOAD_FORMAT = 1); a reader rejects any other
    5       1     reserved, 0
    6       2     rank (u16): the engine rank reporting
    8       8     step (u64): the engine step the counts belong to (all ranks count steps in lockstep)
    16      8     plan_version (u64): version of the newest plan the engine had applied; 0 = start-up layout
    24      2     num_layers (u16)
    26      4     num_slots (u32): physical expert slots per layer
    30      4·L·S counts (u32) [layer][slot]: tokens this rank sent to each physical slot

A step's load is the sum over ranks. Counts are per physical slot because that is what the gate sees; the
planner maps them back to logical experts through the layout that was in force (``plan_version``).

Plan (planner → engines, JSON, one per applied layer plan): see ``PlanMessage``.
"""

from __future__ import annotations

import dataclasses
import json
import struct

import numpy as np

from services.eplb.layout import Layout

LOAD_MAGIC = b"SKEL"
LOAD_FORMAT = 1
PLAN_FORMAT = 1
_HEADER = struct.Struct("<4sBxHQQHI")


class MessageError(ValueError):
    """A malformed or unsupported message."""


@dataclasses.dataclass(frozen=True)
class LoadReport:
    """One engine rank's expert-slot counts for one step."""

    rank: int  # engine rank that counted
    step: int  # engine step (lockstep across ranks)
    plan_version: int  # newest plan the engine had applied when counting; 0 = start-up layout
    counts: np.ndarray  # [layer, physical slot] tokens, non-negative integers

    def encode(self) -> bytes:
        counts = np.ascontiguousarray(self.counts, dtype="<u4")
        if counts.ndim != 2:
            raise MessageError(f"counts must be layers × slots, got shape {counts.shape}")
        header = _HEADER.pack(
            LOAD_MAGIC, LOAD_FORMAT, self.rank, self.step, self.plan_version, counts.shape[0], counts.shape[1]
        )
        return header + counts.tobytes()


def decode_load(data: bytes) -> LoadReport:
    if len(data) < _HEADER.size:
        raise MessageError(f"load report too short: {len(data)} bytes, header is {_HEADER.size}")
    magic, fmt, rank, step, plan_version, num_layers, num_slots = _HEADER.unpack_from(data)
    if magic != LOAD_MAGIC:
        raise MessageError(f"not a load report (magic {magic!r})")
    if fmt != LOAD_FORMAT:
        raise MessageError(f"load report format {fmt} is not supported (this planner reads {LOAD_FORMAT})")
    expected = _HEADER.size + 4 * num_layers * num_slots
    if len(data) != expected:
        raise MessageError(f"load report of {num_layers}×{num_slots} counts needs {expected} bytes, got {len(data)}")
    counts = np.frombuffer(data, dtype="<u4", offset=_HEADER.size).reshape(num_layers, num_slots)
    return LoadReport(rank, step, plan_version, counts.astype(np.int64))


@dataclasses.dataclass(frozen=True)
class PlanMessage:
    """A layout for one layer that engines should apply; later versions supersede earlier ones."""

    version: int  # monotonic over all plans this planner published (all layers), from 1
    layer: int  # MoE layer the layout is for
    step: int  # completed steps the planner had seen when it planned
    layout: Layout  # the new placement (maps derived from phy2log)
    moe_lb_before: float  # the layout it replaces, on the planning window
    moe_lb_after: float  # this layout, on the planning window
    moves: int  # slots whose expert changes
    bytes_moved: int  # weight bytes those moves copy

    def encode(self) -> bytes:
        return json.dumps(
            {
                "format": PLAN_FORMAT,
                "version": self.version,
                "layer": self.layer,
                "step": self.step,
                "num_gpus": self.layout.num_gpus,
                "num_logical": self.layout.num_logical,
                "phy2log": list(self.layout.phy2log),
                "log2phy": self.layout.log2phy(),
                "moe_lb_before": self.moe_lb_before,
                "moe_lb_after": self.moe_lb_after,
                "moves": self.moves,
                "bytes_moved": self.bytes_moved,
            }
        ).encode()


def decode_plan(data: bytes) -> PlanMessage:
    try:
        obj = json.loads(data)
        if obj["format"] != PLAN_FORMAT:
            raise MessageError(f"plan format {obj['format']} is not supported (reads {PLAN_FORMAT})")
        return PlanMessage(
            version=int(obj["version"]),
            layer=int(obj["layer"]),
            step=int(obj["step"]),
            layout=Layout.from_dict(obj),
            moe_lb_before=float(obj["moe_lb_before"]),
            moe_lb_after=float(obj["moe_lb_after"]),
            moves=int(obj["moves"]),
            bytes_moved=int(obj["bytes_moved"]),
        )
    except (ValueError, KeyError, TypeError) as err:
        if isinstance(err, MessageError):
            raise
        raise MessageError(f"malformed plan: {err}") from None
