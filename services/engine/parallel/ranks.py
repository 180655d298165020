"""The driver of a data-parallel group: starts one process per rank, spreads requests over them by load,
gathers their outputs, and stops the whole group when any rank is lost.

Requests are assigned in order, each to the rank with the least work so far (prompt plus max tokens;
ties to the lower rank). Their ids are the caller's, unique across the group. A rank that dies or reports
an error ends the call with a ``RuntimeError`` naming it; the other ranks, blocked in a collective with
the lost one, fail within ``rank_timeout_s`` (gloo fails at once on a closed connection) and every rank
process is stopped, so none is left behind.
"""

from __future__ import annotations

import dataclasses
import queue
import tempfile
import time
from pathlib import Path

import torch.multiprocessing as mp

from services.engine.outputs import RequestOutput
from services.engine.parallel.rank import RankSpec, rank_main, settle_live_layouts
from services.engine.sampling_params import SamplingParams
from services.eplb.layout import Layout
from services.worker.parallel.live_layouts import LayoutUpdate

Request = tuple[str, list[int], SamplingParams]
# Seconds between checks that every rank process is alive while waiting for results.
POLL_S = 0.2


def spread_by_load(requests: list[Request], world_size: int) -> list[list[Request]]:
    """Each request, in order, to the rank with the least assigned tokens (prompt + max tokens)."""
    loads = [0] * world_size
    shares: list[list[Request]] = [[] for _ in range(world_size)]
    for request in requests:
        r = min(range(world_size), key=lambda i: (loads[i], i))
        shares[r].append(request)
        loads[r] += len(request[1]) + (request[2].max_tokens or 0)
    return shares


class Ranks:
    def __init__(self, spec_without_rendezvous: RankSpec, start_timeout_s: float = 600.0) -> None:
        """Starts the ranks and waits until every one has built its engine (or raises)."""
        self.world_size = spec_without_rendezvous.config.data_parallel_size
        self._dir = tempfile.TemporaryDirectory(prefix="shinkai-ranks-")
        rendezvous = Path(self._dir.name) / "rendezvous"
        spec = dataclasses.replace(spec_without_rendezvous, init_method=f"file://{rendezvous}")
        ctx = mp.get_context("spawn")
        self._results = ctx.Queue()
        self._commands = [ctx.Queue() for _ in range(self.world_size)]
        self.processes = [
            ctx.Process(
                target=rank_main,
                args=(r, spec, self._commands[r], self._results),
                name=f"shinkai-rank-{r}",
                daemon=True,
            )
            for r in range(self.world_size)
        ]
        self._closed = False
        self.num_layout_versions = 0  # live EPLB versions submitted (submit_layouts)
        # Per rank: boundary of the next generate call → updates that rank receives there.
        self._updates_at: list[dict[int, list[LayoutUpdate]]] = [{} for _ in range(self.world_size)]
        for p in self.processes:
            p.start()
        self._gather("ready", start_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]  # type: ignore[misc]

    def generate(self, requests: list[Request]) -> list[RequestOutput]:
        """Runs every request to completion across the group; outputs in the order of ``requests``."""
        if self._closed:
            raise RuntimeError("this data-parallel group is stopped")
        shares = spread_by_load(requests, self.world_size)
        for command, share, updates_at in zip(self._commands, shares, self._updates_at):
            command.put(("generate", (share, updates_at)))
        self._updates_at = [{} for _ in range(self.world_size)]
        outputs = {o.request_id: o for part in self._gather("done", None) for o in part}
        return [outputs[request_id] for request_id, _, _ in requests]

    def submit_layouts(self, layouts: dict[int, Layout], at_step: int | list[int] = 0) -> int:
        """Live EPLB: ``layouts`` (layer → new layout) reach the ranks during the next ``generate`` call,
        just before its step ``at_step`` (one step for all, or one per rank; a step past the call's end:
        at its end). The moves run in the background and the layouts take effect at the first step
        boundary where every rank has them staged (services/worker/parallel/live_layouts.py). Returns the
        update's version."""
        steps = [at_step] * self.world_size if isinstance(at_step, int) else list(at_step)
        if len(steps) != self.world_size or any(k < 0 for k in steps):
            raise ValueError(f"at_step must be a step ≥ 0 or one per rank ({self.world_size}), got {at_step!r}")
        self.num_layout_versions += 1
        update = LayoutUpdate(self.num_layout_versions, dict(layouts))
        for r, k in enumerate(steps):
            self._updates_at[r].setdefault(k, []).append(update)
        return update.version

    def settle_layouts(self, timeout_s: float = 60.0) -> list[int]:
        """Between calls: delivers submitted layouts and waits (idle boundary votes) until every one is in
        force; the version in force, by rank."""
        if any(self._updates_at):
            self.generate([])
        return self.call(settle_live_layouts, timeout_s)

    def call(self, fn, *args) -> list:
        """``fn(rank_engine, *args)`` on every rank at once (a module-level function, so it crosses the spawn);
        the results by rank."""
        if self._closed:
            raise RuntimeError("this data-parallel group is stopped")
        for command in self._commands:
            command.put(("call", (fn, args)))
        return self._gather("done", None)

    def _gather(self, kind: str, timeout_s: float | None) -> list:
        """One ``kind`` message from every rank, by rank; stops the group and raises on a lost rank."""
        got: dict[int, object] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(got) < self.world_size:
            try:
                message, rank, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                lost = [(r, p.exitcode) for r, p in enumerate(self.processes) if r not in got and not p.is_alive()]
                if lost:
                    self._fail(f"data-parallel rank {lost[0][0]} exited with code {lost[0][1]}")
                if deadline is not None and time.monotonic() > deadline:
                    self._fail(
                        f"data-parallel ranks {sorted(set(range(self.world_size)) - set(got))} did not "
                        f"answer {kind!r} within {timeout_s} s"
                    )
                continue
            if message == "error":
                time.sleep(POLL_S)  # a peer's loss often shows first as this rank's failed collective
                lost = [
                    f"rank {r} exited with code {p.exitcode}"
                    for r, p in enumerate(self.processes)
                    if r != rank and not p.is_alive()
                ]
                self._fail(
                    f"data-parallel rank {rank} failed{' (' + ', '.join(lost) + ')' if lost else ''}:\n{payload}"
                )
            if message != kind:
                self._fail(f"data-parallel rank {rank} sent {message!r} while the group waited for {kind!r}")
            got[rank] = payload
        return [got[r] for r in range(self.world_size)]

    def _fail(self, reason: str) -> None:
        self.close(graceful=False)
        raise RuntimeError(f"{reason}; the data-parallel group is stopped")

    def close(self, graceful: bool = True) -> None:
        """Stops every rank process (asking first when ``graceful``); idempotent."""
        if self._closed:
            return
        self._closed = True
        if graceful:
            for command in self._commands:
                command.put(None)
            for p in self.processes:
                p.join(timeout=10)
        for p in self.processes:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        self._dir.cleanup()

    def __del__(self) -> None:
        try:
            self.close(graceful=False)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
