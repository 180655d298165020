"""EPLB layouts applied live: expert weights move in the background, the new slot map takes effect at one
step boundary agreed by every rank.

An update (``LayoutUpdate``) is a version and new layouts for some layers. Its life on every rank:

1. **received** (``receive``, any thread): versions arrive in order, one by one from 1 (a refused plan still
   takes its version, with no layouts, so versions stay contiguous); a gap or an old version is refused
   with a log line and nothing else arrives after a gap.
2. **started**, at a step boundary, once every rank has received it (the boundary vote's MIN of received
   versions): the rank's mover thread copies the weights its new slots need from peers over the moves
   group (``moved_weights``) into spare tensors, while steps go on with the old layout. A layer that moves
   in place (``moves_in_place``: the kernel layer) stages only its changed slots, and its move starts from
   the stacks in force, so the mover first waits until the layer's previous move is in force (every rank
   waits for the same agreed switch, so the movers' collectives still line up). Every rank starts
   the same versions in the same order, so the movers' collectives line up, and none waits on a version
   a peer has not received.
3. **staged**: its moves are done (on a GPU, the mover's stream is synchronised first).
4. **in force**, at the first step boundary at which every rank has staged it (the vote's MIN of staged
   versions): the layers take the staged weights (``put_expert_weights``: the torch MoE swaps its
   parameters; the kernel layer copies the changed slots into its stacks in place, on the step's stream,
   so graphs captured on them stay valid), the slot maps are rewritten in place (``ExpertSlots.assign``),
   and the next step routes by them on every rank. ``switches`` logs (version, boundary) for each.

The boundary is the work-left vote before each step (``HostVote.any_rank``, which carries the received and
staged versions in the same all-reduce), so agreeing costs no extra collective and every rank sees the same
result at the same boundary. No step waits for a move: a switch is a few pointer swaps.

Counts taken per physical slot (``ExpertParallel.slot_counts``) of a switched layer are dropped at the
switch: they counted slots of the old layout (the served loop takes them after every step, so none are
pending at a boundary there).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass

import torch

from services.eplb.layout import Layout
from services.worker.parallel.ep_kernel_moe import ExpertParallelKernelMoE
from services.worker.parallel.ep_moe import ExpertParallel, ExpertParallelMoE
from services.worker.parallel.expert_moves import changed_slots, moved_weights

log = logging.getLogger("shinkai.worker.live_layouts")

# Seconds between a mover's checks that the previous move of a layer that moves in place is in force.
WAIT_POLL_S = 0.002

Weights = tuple[torch.Tensor, ...]  # one layer's slot tensors on this rank (its ``expert_weights``), slot order


@dataclass(frozen=True)
class LayoutUpdate:
    """New layouts for some layers, under one version."""

    version: int  # 1, 2, 3, …: one more than the update before it
    layouts: dict[int, Layout]  # layer → its new layout; empty for a refused plan (the version is used up)


@dataclass(frozen=True)
class BoundaryVote:
    """What a rank reports at a step boundary, and (reduced) what the group agreed."""

    received: int  # newest version received (contiguous from 1); 0: none
    staged: int  # newest version whose moves are done; 0: none


class LiveLayouts:
    def __init__(
        self,
        moes: list[ExpertParallelMoE | ExpertParallelKernelMoE],
        parallel: ExpertParallel,
        group: torch.distributed.ProcessGroup,
    ) -> None:
        self.moes = moes  # every layer's expert-parallel MoE, by layer
        self.parallel = parallel
        self.group = group  # the moves group (never the exchange group)
        self.rank = parallel.slots[0].rank
        self.version = 0  # newest version in force
        self.switches: list[tuple[int, int]] = []  # (version, boundary index) of each switch, in order
        self.num_boundaries = 0  # step boundaries seen (the same on every rank)
        self.num_received_from_peers = 0  # experts copied from peers by the mover
        self.error: str | None = None  # why the mover stopped; None while it works
        self.agreed = BoundaryVote(0, 0)  # the group's vote at the latest boundary
        self._lock = threading.Lock()
        self._updates: dict[int, LayoutUpdate] = {}  # received, not yet in force
        self._received = 0
        self._gap = False  # a version was skipped: nothing more is received
        self._started = 0
        self._staged = 0  # written by the mover thread
        # version → staged (layer, layout, weights, changed slots): a layer that moves in place stages only
        # the changed slots' tensors, the others every slot's
        self._done: dict[int, list[tuple[int, Layout, Weights, list[int]]]] = {}
        # The newest layout and weights of each layer, staged or in force: what the next move of a layer that
        # swaps its tensors starts from (read and written by the mover thread only, after construction).
        self._latest = self._in_force()
        # Layer → the newest version the mover staged for it (mover thread only): a layer that moves in place
        # starts its next move once that version is in force.
        self._staged_for: dict[int, int] = {}
        # On a GPU, the step stream's event after the latest switch's copies: the mover reads the stacks after it.
        self._written: torch.cuda.Event | None = None
        self._closed = threading.Event()
        self._work: queue.Queue[LayoutUpdate | None] = queue.Queue()
        self._thread = threading.Thread(target=self._move, name=f"eplb-moves-{self.rank}", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------

    def receive(self, update: LayoutUpdate) -> bool:
        """Takes the next version; False (and a log line naming why) for an old version, after a gap, or for
        layouts of another shape than this group's (that version is used up with no layouts)."""
        with self._lock:
            if update.version <= self._received:
                log.warning(
                    "EPLB plan version %d refused: version %d was received already", update.version, self._received
                )
                return False
            if self._gap or update.version != self._received + 1:
                if not self._gap:
                    log.error(
                        "EPLB plan version %d arrived after %d: version %d was lost, so no later plan "
                        "is applied on this group",
                        update.version,
                        self._received,
                        self._received + 1,
                    )
                self._gap = True
                return False
            why = self._refusal(update)
            if why is not None:  # refused alike on every rank: its version is used up, nothing moves
                log.error("EPLB plan version %d refused: %s", update.version, why)
                update = LayoutUpdate(update.version, {})
            self._updates[update.version] = update
            self._received = update.version
            return why is None

    def _refusal(self, update: LayoutUpdate) -> str | None:
        """Why ``update`` cannot apply to this group's layers, or None."""
        for layer, layout in update.layouts.items():
            if not 0 <= layer < len(self.moes):
                return f"layer {layer} is outside this model's {len(self.moes)} MoE layers"
            here = self.parallel.slots[layer].layout
            for what, got, want in (
                ("ranks", layout.num_gpus, here.num_gpus),
                ("expert slots", layout.num_slots, here.num_slots),
                ("logical experts", layout.num_logical, here.num_logical),
            ):
                if got != want:
                    return f"layer {layer}'s layout has {got} {what}, this group has {want}"
        return None

    @property
    def num_received(self) -> int:
        return self._received

    # ---- the step thread --------------------------------------------------------------------

    def local(self) -> BoundaryVote:
        """This rank's part of the boundary vote."""
        return BoundaryVote(self._received, self._staged)

    def at_boundary(self, agreed: BoundaryVote) -> list[int]:
        """At a step boundary, with the group's MIN of every rank's ``local()``: puts in force every staged
        version up to ``agreed.staged`` and starts the moves of those up to ``agreed.received``. Returns the
        versions put in force."""
        boundary = self.num_boundaries
        self.num_boundaries += 1
        self.agreed = agreed
        switched = []
        for version in range(self.version + 1, agreed.staged + 1):
            start = time.perf_counter()
            staged = self._done.pop(version)
            for layer, layout, weights, changed in staged:
                self._put_in_force(layer, layout, weights, changed)
            if staged and self.parallel.slot_counts.is_cuda:  # before ``version``: the mover waits on both
                event = torch.cuda.Event()
                event.record()
                self._written = event
            with self._lock:
                self._updates.pop(version, None)
            self.version = version
            self.switches.append((version, boundary))
            log.info(
                "EPLB version %d in force from boundary %d: layers %s moved, switched in %.3f ms",
                version,
                boundary,
                [layer for layer, *_ in staged],
                1e3 * (time.perf_counter() - start),
            )
            switched.append(version)
        for version in range(self._started + 1, agreed.received + 1):
            self._work.put(self._updates[version])
            self._started = version
        return switched

    def _put_in_force(self, layer: int, layout: Layout, weights: Weights, changed: list[int]) -> None:
        self.moes[layer].put_expert_weights(weights, changed)
        self.parallel.slots[layer].assign(layout)
        self.parallel.slot_counts[layer].zero_()

    @property
    def settled(self) -> bool:
        """Every version the group had received at the latest boundary is in force (the same on every rank)."""
        return self.version >= self.agreed.received

    def resync(self) -> None:
        """After the layers were moved outside this object (``apply_layouts`` between calls): later moves
        start from what is in force now. Only while every received version is in force."""
        if self._received != self.version:
            raise ValueError(
                f"EPLB versions {self.version + 1}..{self._received} are on their way; a layout "
                "cannot be applied beside them"
            )
        self._latest = self._in_force()  # the mover is idle: everything it started is in force

    def _in_force(self) -> list[tuple[Layout, Weights]]:
        return [(self.parallel.slots[i].layout, m.expert_weights()) for i, m in enumerate(self.moes)]

    def close(self) -> None:
        self._closed.set()
        self._work.put(None)

    # ---- the mover thread -------------------------------------------------------------------

    def _move(self) -> None:
        device = self.parallel.slot_counts.device
        stream = None
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this thread's collectives and tensors on the rank's GPU
            stream = torch.cuda.Stream(device)
        while True:
            update = self._work.get()
            if update is None:
                return
            try:
                staged = []
                with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                    for layer in sorted(update.layouts):
                        new = update.layouts[layer]
                        if self.moes[layer].moves_in_place:
                            if not self._wait_in_force(self._staged_for.get(layer, 0)):
                                return  # closed
                            old, weights = self.parallel.slots[layer].layout, self.moes[layer].expert_weights()
                            changed: list[int] | None = changed_slots(old, new, self.rank)
                            written = self._written
                            if stream is not None and written is not None:  # a switch's copies into the stacks
                                stream.wait_event(written)
                        else:
                            (old, weights), changed = self._latest[layer], None
                        new_weights, received = moved_weights(old, self.rank, weights, new, self.group, changed)
                        if changed is None:
                            self._latest[layer] = (new, new_weights)
                            changed = changed_slots(old, new, self.rank)
                        self._staged_for[layer] = update.version
                        staged.append((layer, new, new_weights, changed))
                        self.num_received_from_peers += received
                if stream is not None:
                    stream.synchronize()  # the compute stream may read them from the switch on
                self._done[update.version] = staged
                self._staged = update.version
            except Exception as err:  # noqa: BLE001 - a lost peer: no later version is staged; steps go on
                log.exception("EPLB moves of version %d failed; this group applies no later plan", update.version)
                self.error = f"{type(err).__name__}: {err}"
                return

    def _wait_in_force(self, version: int) -> bool:
        """Waits until ``version`` is in force (the step thread switches it at an agreed boundary); False if
        this object was closed first."""
        while self.version < version:
            if self._closed.wait(WAIT_POLL_S):
                return False
        return True
