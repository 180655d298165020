"""Engram tables held in host shared memory, the rows a step needs copied to the device (``--engram-on-host``).

V4.1-Flash's Engram tables (~200 GB in FP8) do not fit a GPU. With ``engram_on_host`` every table's
row-indexed tensors (an ``nn.Embedding``'s ``weight``; ``Fp8RowwiseEmbedding``'s ``weight_fp8`` and
``scale``) live once per host in one ``EngramSegment``: a file in /dev/shm named per model, mapped
MAP_SHARED by every rank process of the host, so its pages exist once. Each table module becomes a
``HostEngramTable``; a step's rows are ``stage``d before its forward: the host gathers only those rows
into a pinned buffer and copies them to the device (``non_blocking`` on CUDA), then the table's forward
runs the original module on the gathered rows (``torch.func.functional_call`` with local ids 0..n−1),
so each output row is the same computation on the same bytes as the device-held table's: ``==``.

Invariants:
- A segment's file is whole before anyone can open it: the creator writes it under a private name and
  publishes it with one ``link``; every user holds a shared flock on it while it uses it.
- The last user to ``close`` removes the file (it gets the exclusive flock back); a user whose open raced a
  removal sees a different inode at the path and opens again. A process that dies holding it drops its
  flock with it; its file stays until the next user of that name closes.
- A pinned buffer is not refilled before its previous copy to the device finished (a CUDA event).
- A static stage (the CUDA-graph decode step) writes into a persistent device buffer, so a captured
  graph only ever reads that buffer: the gather and the copy are host work done before the replay.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import struct
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from model.deepseek_v41.engram import Engram

SHM_DIR = "/dev/shm"
_MAGIC = b"SHKENGRM"
_HEADER = 64  # magic (8), layout version 1 (8), segment bytes (8), then zeros
_ALIGN = 4096


@dataclass(frozen=True)
class _Field:
    """One row-indexed tensor of one table inside the segment."""

    table: int  # index of the Engram layer's table, in layer order
    name: str  # the tensor's name in its module (``weight``, ``weight_fp8``, ``scale``)
    dtype: torch.dtype
    shape: tuple[int, ...]  # [rows, ...]
    offset: int  # byte offset in the segment, page-aligned

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * torch.empty((), dtype=self.dtype).element_size()


def _row_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """The table module's row-indexed tensors by name (every parameter and buffer: all are [rows, ...])."""
    return {**dict(module.named_parameters(recurse=False)), **dict(module.named_buffers(recurse=False))}


def _layout(tables: list[dict[str, torch.Tensor]]) -> tuple[list[_Field], int]:
    fields, offset = [], _HEADER
    for i, tensors in enumerate(tables):
        for name, t in tensors.items():
            offset = -(-offset // _ALIGN) * _ALIGN
            field = _Field(i, name, t.dtype, tuple(t.shape), offset)
            fields.append(field)
            offset += field.nbytes
    return fields, offset


def segment_name(tables: list[dict[str, torch.Tensor]]) -> str:
    """A name per model: the tables' layout and a sample of their bytes (first and last row of each tensor),
    so ranks of one host that load the same model share a segment and another model never does."""
    digest = hashlib.sha256()
    for tensors in tables:
        for name, t in tensors.items():
            digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
            for row in (t[:1], t[-1:]):
                digest.update(row.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return f"shinkai-engram-{os.getuid()}-{digest.hexdigest()[:24]}"


class EngramSegment:
    """The tables' shared file, mapped: ``tensors[i][name]`` are CPU tensors over the shared pages."""

    def __init__(self, name: str, tables: list[dict[str, torch.Tensor]], directory: str = SHM_DIR) -> None:
        """Maps segment ``name``, creating it from ``tables`` (any device) when no user holds it yet."""
        self.path = os.path.join(directory, name)
        self.fields, self.nbytes = _layout(tables)
        self.created = False
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR)
            except FileNotFoundError:
                if self._create(tables):
                    fd = self._fd
                    break
                continue  # another process published it first: join theirs
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)  # the last user removed it while this open waited: open the path again
        size = os.fstat(fd).st_size
        if size != self.nbytes:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise ValueError(
                f"{self.path} holds {size} bytes, this model's Engram tables {self.nbytes}: "
                "another model under the same name"
            )
        if not self.created:
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        if struct.unpack_from("<8sQQ", self._map, 0) != (_MAGIC, 1, self.nbytes):
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            raise ValueError(f"{self.path} is not an Engram segment of this layout: remove it")
        self._closer = weakref.finalize(self, _close, fd, self.path)
        self.tensors: list[dict[str, torch.Tensor]] = [{} for _ in tables]
        for f in self.fields:
            raw = torch.frombuffer(self._map, dtype=torch.uint8, count=f.nbytes, offset=f.offset)
            self.tensors[f.table][f.name] = raw.view(f.dtype).view(f.shape)

    def _create(self, tables: list[dict[str, torch.Tensor]]) -> bool:
        """Write the segment under a private name, then publish it whole with one link (atomic): readers
        never see a partial file. False when another process published first."""
        tmp = f"{self.path}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            for f in self.fields:
                dst = torch.frombuffer(self._map, dtype=torch.uint8, count=f.nbytes, offset=f.offset)
                dst.view(f.dtype).view(f.shape).copy_(tables[f.table][f.name].detach())
            struct.pack_into("<8sQQ", self._map, 0, _MAGIC, 1, self.nbytes)
            fcntl.flock(fd, fcntl.LOCK_SH)  # held before it is visible: a closing user cannot remove it
            os.link(tmp, self.path)
        except FileExistsError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(tmp)
        self._fd, self.created = fd, True
        return True

    def close(self) -> None:
        """Drops this user's hold; the last user removes the file. The mapping itself lives on while tensors
        over it do (their pages are freed with the last of them). Also run at exit or when collected."""
        self._closer()


def _close(fd: int, path: str) -> None:
    fcntl.flock(fd, fcntl.LOCK_UN)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pass  # another user still holds it
    else:
        if os.path.exists(path) and os.stat(path).st_ino == os.fstat(fd).st_ino:
            os.unlink(path)
    os.close(fd)


class HostEngramTable(nn.Module):
    """Stands in for an Engram table module: local ids int [...] (0..n−1: places in the last ``stage``) →
    the original module's output [..., C], computed on the staged rows."""

    def __init__(self, shell: nn.Module, host: dict[str, torch.Tensor], device: torch.device) -> None:
        super().__init__()
        self.shell = [shell]  # the original module, its tensors dropped (a list: not a registered child)
        self.host = host  # name → CPU tensor [rows, ...] over the shared segment
        self.device = device
        self.staged: dict[str, torch.Tensor] = {}  # name → device [n, ...]: the rows of the last stage
        self._pinned: dict[str, torch.Tensor] = {}  # name → pinned CPU [capacity, ...] (CUDA only)
        self._copied: torch.cuda.Event | None = None  # the last copy out of the pinned buffers
        self._ready: torch.cuda.Event | None = None  # an eager stage's copy, not yet waited for
        self._stream: torch.cuda.Stream | None = None  # the eager stages' copy stream (CUDA)
        # The segment ``host`` maps, held while the model holds this table: a second runner on the same model
        # (the engine's, after the pool-sizing probe's was dropped) then opens it again instead of copying the
        # tables into a new one while the old pages are still mapped (twice the tables in /dev/shm).
        self.segment: EngramSegment | None = None

    def stage(self, rows: torch.Tensor, out: dict[str, torch.Tensor] | None = None) -> None:
        """Gather ``rows`` (global ids, flattened: n of them) from the host and start their copy to the
        device: into ``out`` (persistent device buffers [≥ n, ...], the graph path: the copy is queued on
        the current stream, before the replay) or into new tensors (eager: on a copy stream, so it
        overlaps the layers before the Engram layer; the forward waits for it)."""
        flat = rows.reshape(-1).cpu()  # the ids come from the device's Engram history: one read-back
        n = flat.numel()
        cuda = self.device.type == "cuda"
        staged = {}
        if not cuda:
            for name, table in self.host.items():
                dst = table.new_empty((n, *table.shape[1:])) if out is None else out[name][:n]
                torch.index_select(table, 0, flat, out=dst)  # on the CPU the gather is the copy
                staged[name] = dst
            self.staged = staged
            return
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers' previous copy is done before they are refilled
        current = torch.cuda.current_stream(self.device)
        if out is None:
            if self._stream is None:
                self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(current)  # the new buffers' memory is free on the compute stream too
        stream = current if out is not None else self._stream
        for name, table in self.host.items():
            pinned = self._pinned.get(name)
            if pinned is None or pinned.shape[0] < n:
                pinned = torch.empty((n, *table.shape[1:]), dtype=table.dtype, pin_memory=True)
                self._pinned[name] = pinned
            torch.index_select(table, 0, flat, out=pinned[:n])
            dst = (
                torch.empty((n, *table.shape[1:]), dtype=table.dtype, device=self.device)
                if out is None
                else out[name][:n]
            )
            with torch.cuda.stream(stream):
                dst.copy_(pinned[:n], non_blocking=True)
            staged[name] = dst
        self._copied = torch.cuda.Event()
        self._copied.record(stream)
        self._ready = self._copied if out is None else None
        self.staged = staged

    def forward(self, local: torch.Tensor) -> torch.Tensor:
        """Device ops only (graph-safe): the original module's forward over the staged rows."""
        if self._ready is not None:  # an eager stage's copy stream: the compute stream waits for it here
            torch.cuda.current_stream(self.device).wait_event(self._ready)
            self._ready = None
        return torch.func.functional_call(self.shell[0], self.staged, (local,))


class EngramHost:
    """Every Engram table of ``model.layers`` moved into one host segment; ``stage`` a step's rows."""

    def __init__(self, engrams: list[Engram], device: torch.device, directory: str = SHM_DIR) -> None:
        # A model a runner already moved (the pool-sizing probe's, before the engine's own runner) keeps its
        # original modules as shells and its tables in the first segment: those are the tables again.
        tables = [e.embed.host if isinstance(e.embed, HostEngramTable) else _row_tensors(e.embed) for e in engrams]
        self.segment = EngramSegment(segment_name(tables), tables, directory)
        self.tables: list[HostEngramTable] = []
        for engram, host in zip(engrams, self.segment.tensors):
            shell = engram.embed.shell[0] if isinstance(engram.embed, HostEngramTable) else engram.embed
            for name in host:  # drop the device copy: the segment holds the table now
                setattr(shell, name, None)  # nn.Module keeps the name registered, as a None parameter or buffer
            table = HostEngramTable(shell, host, device)
            table.segment = self.segment
            engram.embed = table
            self.tables.append(table)

    @classmethod
    def of_model(cls, model: nn.Module, directory: str = SHM_DIR) -> "EngramHost":
        engrams = [m for block in model.layers for m in block.modules() if isinstance(m, Engram)]
        if not engrams:
            raise ValueError("engram_on_host: this model has no Engram layer")
        return cls(engrams, model.embed.weight.device, directory)

    def stage(self, rows: torch.Tensor, out: list[dict[str, torch.Tensor]] | None = None) -> torch.Tensor:
        """rows [B, S, L, heads] (every Engram layer's global ids, ``engram_rows``): each table stages its
        layer's rows; returns the local ids [B, S, L, heads] the blocks then read in their place."""
        with torch.profiler.record_function("engram_host.stage"):  # a row in a profile of the step's host work
            for i, table in enumerate(self.tables):
                table.stage(rows[..., i, :], None if out is None else out[i])
        return local_rows(rows.shape, rows.device)

    def static_buffers(self, num_rows: int) -> list[dict[str, torch.Tensor]]:
        """Persistent device buffers for ``num_rows`` table rows of every table (the graph step's input)."""
        return [
            {
                name: torch.empty((num_rows, *t.shape[1:]), dtype=t.dtype, device=table.device)
                for name, t in table.host.items()
            }
            for table in self.tables
        ]

    def close(self) -> None:
        self.segment.close()


def local_rows(shape: torch.Size, device: torch.device) -> torch.Tensor:
    """The staged rows' places for a rows tensor of ``shape`` [B, S, L, heads]: the same per layer."""
    b, s, num_layers, heads = shape
    local = torch.arange(b * s * heads, device=device).view(b, s, 1, heads)
    return local.expand(b, s, num_layers, heads)
