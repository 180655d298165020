"""The NORMAL engine's votes as real collectives: an all-reduce of one bool over the host (gloo) vote group.

The scheduler calls ``vote(value, "all")`` at ALL points and ``vote(value, "any")`` at ANY points and for
its second vote ("did any rank schedule prefill?"), scheduler_rs/src/scheduler/prefill.rs; the rank loop
calls ``any_rank(has_work)`` before every step ("is there work left anywhere?"). ALL is a MIN over the
ranks' 0/1, ANY a MAX. Each is a small tensor on the host, so a vote never syncs a device.

With live EPLB (``live`` set, services/worker/parallel/live_layouts.py) the work-left vote is also the step
boundary at which layouts switch: the same all-reduce (a MAX over [has work, −received, −staged]) carries
each rank's newest received and staged plan versions, so the group agrees on them at no extra collective,
and every rank hands the agreed MINs to ``live.at_boundary`` before it steps.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_OPS = {"all": dist.ReduceOp.MIN, "any": dist.ReduceOp.MAX}


class HostVote:
    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.num_votes = 0  # collectives this rank has joined (every rank joins the same number)
        self.live: Any = None  # the rank's LiveLayouts (services/worker/parallel/live_layouts.py); None: none

    def __call__(self, value: bool, op: str) -> bool:
        if op not in _OPS:
            raise ValueError(f"a vote is 'all' or 'any', got {op!r}")
        t = torch.tensor([int(value)], dtype=torch.int32)
        dist.all_reduce(t, op=_OPS[op], group=self.group)
        self.num_votes += 1
        return bool(t.item())

    def any_rank(self, value: bool) -> bool:
        """The work-left vote: True while any rank has unfinished requests. With ``live``, also the step
        boundary of live EPLB (module docstring)."""
        live = self.live
        if live is None:
            return self(value, "any")
        mine = live.local()
        t = torch.tensor([int(value), -mine.received, -mine.staged], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        self.num_votes += 1
        busy, received, staged = t.tolist()
        live.at_boundary(type(mine)(received=-received, staged=-staged))
        return bool(busy)
