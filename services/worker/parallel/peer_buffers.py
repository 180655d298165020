"""One rank's fixed-capacity buffers for the kernel backend's expert exchange (DeepEP's low-latency layout).

Per peer the rank keeps ``capacity`` rows, ``capacity = pass_tokens × top_k``: a token's k picks may all go to
one peer, and a pass holds at most ``pass_tokens`` tokens (``max_num_seqs × (1 + drafts)``, the largest decode
step, so a decode step is one pass). Byte layout (W ranks, C = capacity, D = hidden size):

- ``rows``   [W·C + 1, D] the hidden rows, the model's dtype: block p (rows p·C … p·C + C − 1) goes to rank p,
  filled from its start; the last row is the dump where pairs that go nowhere (dead rows, a placeholder
  step) are written, never sent.
- ``meta``   [W·C + 1, 2] int32: each row's slot on its receiver and its route weight's fp32 bits.
- ``counts`` [W, 1] int64: rows sent to each peer (the receiver reads rows 0 … count − 1 of each block).
- ``back``   [W·C, D] bf16: the experts' outputs, returned to the senders in the blocks they came in.

A send buffer and its receive twin have one shape; ``exchanged`` gives the ``[W, C, ...]`` views that
``PeerExchange.all_to_all`` moves. Unused rows keep old bytes: nothing reads past a block's count.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PeerBuffers:
    world_size: int  # W, ranks exchanging
    capacity: int  # C, rows per peer and pass
    send_rows: torch.Tensor  # [W·C + 1, D] model dtype (the last row the dump)
    recv_rows: torch.Tensor  # [W·C, D]
    send_meta: torch.Tensor  # [W·C + 1, 2] int32 (slot on the receiver, weight bits; the last row the dump)
    recv_meta: torch.Tensor  # [W·C, 2]
    send_counts: torch.Tensor  # [W, 1] int64
    recv_counts: torch.Tensor  # [W, 1] int64
    send_back: torch.Tensor  # [W·C, D] bf16 outputs of the rows this rank received
    recv_back: torch.Tensor  # [W·C, D] bf16 outputs of the rows this rank sent

    @staticmethod
    def allocate(world_size: int, capacity: int, hidden: int, dtype: torch.dtype, device) -> "PeerBuffers":
        n = world_size * capacity

        def rows(extra: int, width: int, kind: torch.dtype) -> torch.Tensor:
            return torch.zeros(n + extra, width, dtype=kind, device=device)

        counts = torch.zeros(world_size, 1, dtype=torch.long, device=device)
        return PeerBuffers(
            world_size,
            capacity,
            rows(1, hidden, dtype),
            rows(0, hidden, dtype),
            rows(1, 2, torch.int32),
            rows(0, 2, torch.int32),
            counts,
            counts.clone(),
            rows(0, hidden, torch.bfloat16),
            rows(0, hidden, torch.bfloat16),
        )

    def blocks(self, t: torch.Tensor) -> torch.Tensor:
        """The [W, C, ...] view of a buffer's first W·C rows (what travels)."""
        n = self.world_size * self.capacity
        return t[:n].view(self.world_size, self.capacity, *t.shape[1:])

    def dispatched(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(send, receive) views of the dispatch: counts, rows, meta."""
        return [
            (self.send_counts, self.recv_counts),
            (self.blocks(self.send_rows), self.blocks(self.recv_rows)),
            (self.blocks(self.send_meta), self.blocks(self.recv_meta)),
        ]

    def returned(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(send, receive) views of the combine's return trip."""
        return self.blocks(self.send_back), self.blocks(self.recv_back)
