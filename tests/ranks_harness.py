"""Test harness: runs a function in N spawned rank processes on one gloo rendezvous and gathers what each
returns (or raises), with a deadline, leaving no process behind."""

from __future__ import annotations

import queue
import traceback
from pathlib import Path

import torch.multiprocessing as mp


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _entry(target, rank: int, world_size: int, rendezvous: str, args: tuple, results) -> None:
    try:
        results.put((rank, "ok", target(rank, world_size, rendezvous, *args)))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((rank, "error", traceback.format_exc()))


def run_ranks(target, world_size: int, tmp_path: Path, args: tuple = (), timeout_s: float = 300.0) -> list:
    """``target(rank, world_size, init_method, *args)`` on every rank (a module-level function); its
    results by rank. Raises with the rank's traceback if any rank raised."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    rendezvous = f"file://{tmp_path / 'rendezvous'}"
    procs = [
        ctx.Process(target=_entry, args=(target, r, world_size, rendezvous, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, object] = {}
    try:
        while len(got) < world_size:
            try:
                rank, status, payload = results.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(got))} gave nothing in {timeout_s} s")
            if status == "error":
                raise AssertionError(f"rank {rank} raised:\n{payload}")
            got[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
                p.join()
    return [got[r] for r in range(world_size)]
