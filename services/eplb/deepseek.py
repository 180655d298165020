"""DeepSeek's public EPLB policy, written from its algorithm: the reference for what a balancer should beat.

Source: deepseek-ai/EPLB, ``eplb.py``, ``rebalance_experts`` at commit
d52c72d5b2f2fb4c41afbf8eb21366820239913d (MIT). This module re-implements the algorithm in numpy; no
code is taken from it. The reference plans one layer from one load vector (the window summed over steps):

- **Replication.** Each extra slot copies the expert with the largest load per copy (ties: lower index).
- **Packing.** Items (groups or copies) go heaviest first to the lightest pack that still has room
  (ties: lower pack), each pack taking exactly items / packs items; with one item per pack, item i goes
  to pack i unsorted. An item's rank in its pack is its slot order there.
- **Hierarchical** (``num_groups % num_nodes == 0``): the experts' groups (consecutive blocks of
  ``experts / num_groups``) are packed onto nodes by group load; each node replicates its own experts
  into ``slots / num_nodes`` slots; each node packs its copies onto its ``gpus / num_nodes`` GPUs.
- **Global** (otherwise): the hierarchical policy with one group and one node.

The reference computes in float32 (``weight.float()``), accumulates pack loads in float32 and sorts with
an unstable sort; this module uses the same float32 arithmetic and a stable sort. Items whose float32
weights tie are interchangeable to the packing, so the balance on the summed load matches the reference
whenever float32 resolves the loads (integer counts below 2**24 per copy).
"""

from __future__ import annotations

import numpy as np

from services.eplb.layout import Layout, check_load


class DeepSeekShapeError(ValueError):
    """A shape the reference policy asserts against (groups, nodes, GPUs or slots that do not divide)."""


def _pack(weights: np.ndarray, num_packs: int) -> list[list[int]]:
    """Items per pack, in rank order: balanced packing of float32 ``weights`` into equal-count packs."""
    num_items = len(weights)
    per_pack = num_items // num_packs
    if per_pack == 1:
        return [[i] for i in range(num_items)]
    order = np.argsort(-weights, kind="stable")
    totals = np.zeros(num_packs, dtype=np.float32)  # float32 sums, added in placement order
    open_totals = totals.copy()  # totals, with +inf for full packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    for item in order:
        pack = int(np.argmin(open_totals))  # the first lightest pack with room
        packs[pack].append(int(item))
        totals[pack] += weights[item]
        open_totals[pack] = np.inf if len(packs[pack]) == per_pack else totals[pack]
    return packs


def _replicate(weights: np.ndarray, num_slots: int) -> tuple[list[int], np.ndarray]:
    """(expert of each slot, copies per expert): slots 0..n-1 hold experts 0..n-1, then one copy at a
    time to the largest float32 load per copy, lowest index on ties."""
    num_experts = len(weights)
    copies = np.ones(num_experts, dtype=np.int64)
    slots = list(range(num_experts))
    for _ in range(num_slots - num_experts):
        expert = int(np.argmax(weights / copies.astype(np.float32)))
        slots.append(expert)
        copies[expert] += 1
    return slots, copies


def check_shape(num_logical: int, num_slots: int, num_gpus: int, num_groups: int, num_nodes: int) -> bool:
    """Raises on shapes the reference asserts against; True when the hierarchical policy applies."""
    for name, value in (("num_groups", num_groups), ("num_nodes", num_nodes), ("num_gpus", num_gpus)):
        if value < 1:
            raise DeepSeekShapeError(f"{name} must be ≥ 1, got {value}")
    if num_slots % num_gpus:
        raise DeepSeekShapeError(f"{num_slots} slots do not divide over {num_gpus} GPUs")
    hierarchical = num_groups % num_nodes == 0
    if not hierarchical:
        return False
    if num_logical % num_groups:
        raise DeepSeekShapeError(f"{num_logical} experts do not split into {num_groups} groups")
    if num_gpus % num_nodes:
        raise DeepSeekShapeError(f"{num_gpus} GPUs do not split over {num_nodes} nodes")
    if num_slots < num_logical:
        raise DeepSeekShapeError(f"{num_slots} slots cannot hold {num_logical} experts")
    return True


def deepseek_plan(
    load: np.ndarray, num_gpus: int, num_slots: int, *, num_groups: int = 1, num_nodes: int = 1
) -> Layout:
    """The reference's layout for a ``steps × experts`` window (planned on its sum over steps)."""
    load = np.asarray(load, dtype=np.float64)
    if load.ndim != 2:
        raise ValueError(f"load must be steps × experts, got shape {load.shape}")
    num_logical = load.shape[1]
    load = check_load(load, num_logical)
    if not check_shape(num_logical, num_slots, num_gpus, num_groups, num_nodes):
        num_groups = num_nodes = 1  # the reference's global policy
    weights = load.sum(axis=0).astype(np.float32)
    group_size = num_logical // num_groups
    group_load = weights.reshape(num_groups, group_size).sum(axis=1, dtype=np.float32)
    gpus_per_node = num_gpus // num_nodes
    slots_per_node = num_slots // num_nodes
    if slots_per_node < num_logical // num_nodes:
        raise DeepSeekShapeError(f"{slots_per_node} slots per node cannot hold {num_logical // num_nodes} experts")
    phy2log: list[int] = []
    for node_groups in _pack(group_load, num_nodes):
        experts = np.array([g * group_size + k for g in node_groups for k in range(group_size)])
        slots, copies = _replicate(weights[experts], slots_per_node)
        per_copy = (weights[experts] / copies.astype(np.float32))[slots]
        for gpu_slots in _pack(per_copy, gpus_per_node):
            phy2log.extend(int(experts[slots[s]]) for s in gpu_slots)
    return Layout(tuple(phy2log), num_gpus, num_logical)
