"""One rank's fixed-capacity buffers for the kernel backend's expert exchange (DeepEP's low-latency layout).

Per peer the rank keeps ``capacity`` rows, ``capacity = pass_tokens × top_k``: a token's k picks may all go to
one peer, and a pass holds at most ``pass_tokens`` tokens (``max_num_seqs × (1 + drafts)``, the largest decode
step, so a decode step is one pass). The dispatch is one all-to-all of one byte buffer: block p is what goes to
(or came from) rank p, and each block holds, at fixed offsets (C = capacity, D = hidden size, s = the rows'
element size; R rounded up to a multiple of 8 bytes, the block size B to a multiple of both 16 bytes and a row's
D·s bytes):

- bytes [0, C·D·s)        the rows, the model's dtype, [C, D], filled from the start;
- bytes [R, R + 8·C)      each row's int32 pair: its slot on the receiver and its route weight's fp32 bits;
- bytes [R + 8·C, +8)     the count of rows sent (int64): the receiver reads rows 0 … count − 1.

Since B is a whole number of rows (``block_rows``), the receive buffer is also one [W·block_rows, D] matrix
(``gathered_rows``) in which row c of block p is row p·block_rows + c: the grouped GEMM gathers the received rows
from it in place, with no copy (the rows after each block's C hold its pairs and count, and are never gathered).

The send buffer has one block more than there are ranks, the dump, where pairs that go nowhere (dead rows, a
placeholder step) are written; it is never sent. ``back`` [W·C, D'] bf16 (a second all-to-all) carries the
experts' outputs (D' = ``out_width``, the down products' width: the hidden size padded to the GEMM's multiple
of 128) to the senders in the blocks they came in. The receiving side of that return trip is the head of
``combined`` [W·C + O, D'] bf16, whose last O rows (``own_rows``) take the rank's own tokens' shared expert
outputs: the combine reads every output a token sums from that one tensor. Unused rows keep old bytes: nothing
reads past a block's count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class PeerBuffers:
    world_size: int  # W, ranks exchanging
    capacity: int  # C, rows per peer and pass
    hidden: int  # D, the rows' width
    dtype: torch.dtype  # the rows' dtype (the model's activations)
    send: torch.Tensor  # [W + 1, B] uint8: a block per peer, then the dump
    recv: torch.Tensor  # [W, B] uint8: a block from each peer
    send_back: torch.Tensor  # [W·C, D'] bf16 outputs of the rows this rank received
    combined: torch.Tensor  # [W·C + O, D'] bf16: recv_back, then the O own rows' shared expert outputs

    @property
    def out_width(self) -> int:
        """D', the returned outputs' width."""
        return self.send_back.shape[1]

    @property
    def recv_back(self) -> torch.Tensor:
        """[W·C, D'] bf16 outputs of the rows this rank sent: the head of ``combined``."""
        return self.combined[: self.world_size * self.capacity]

    @staticmethod
    def allocate(
        world_size: int,
        capacity: int,
        hidden: int,
        dtype: torch.dtype,
        device,
        own_rows: int = 0,
        out_width: int | None = None,
    ) -> "PeerBuffers":
        """Buffers for ``capacity`` rows per peer and pass, ``own_rows`` own outputs after the returned ones, and
        outputs ``out_width`` wide (None: ``hidden``)."""
        rows = _round_up(capacity * hidden * dtype.itemsize, 8)
        block = _round_up(rows + 8 * capacity + 8, math.lcm(16, hidden * dtype.itemsize))
        width = hidden if out_width is None else out_width
        send = torch.zeros(world_size + 1, block, dtype=torch.uint8, device=device)
        back = torch.zeros(world_size * capacity, width, dtype=torch.bfloat16, device=device)
        combined = torch.zeros(world_size * capacity + own_rows, width, dtype=torch.bfloat16, device=device)
        return PeerBuffers(world_size, capacity, hidden, dtype, send, send[:world_size].clone(), back, combined)

    @property
    def _meta_offset(self) -> int:
        return _round_up(self.capacity * self.hidden * self.dtype.itemsize, 8)

    def rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """The rows of ``blocks`` ([n, B] uint8, ``send`` or ``recv``): a [n, C, D] view in the rows' dtype."""
        size = self.capacity * self.hidden * self.dtype.itemsize
        return blocks[:, :size].view(self.dtype).unflatten(-1, (self.capacity, self.hidden))

    @property
    def block_rows(self) -> int:
        """A block's size in rows of D elements: block p's row c is row p·block_rows + c of ``gathered_rows``."""
        return self.send.shape[1] // (self.hidden * self.dtype.itemsize)

    def gathered_rows(self, blocks: torch.Tensor) -> torch.Tensor:
        """Dense ``blocks`` ([n, B] uint8) as one [n·block_rows, D] matrix in the rows' dtype (a view)."""
        return blocks.view(self.dtype).view(-1, self.hidden)

    def meta(self, blocks: torch.Tensor) -> torch.Tensor:
        """The (slot, weight bits) pairs of ``blocks``: a [n, C, 2] int32 view."""
        start = self._meta_offset
        return blocks[:, start : start + 8 * self.capacity].view(torch.int32).unflatten(-1, (self.capacity, 2))

    def counts(self, blocks: torch.Tensor) -> torch.Tensor:
        """The row counts of ``blocks``: a [n, 1] int64 view."""
        start = self._meta_offset + 8 * self.capacity
        return blocks[:, start : start + 8].view(torch.int64)

    def dispatched(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, receive) of the dispatch: [W, B] each."""
        return self.send[: self.world_size], self.recv

    def returned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, receive) views of the combine's return trip: [W, C, D'] each."""
        shape = (self.world_size, self.capacity, self.out_width)
        return self.send_back.view(shape), self.recv_back.view(shape)
