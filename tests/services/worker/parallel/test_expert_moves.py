"""The move plan of an EPLB layout change: each new slot's source, the same on every rank."""

from __future__ import annotations

import pytest

from services.eplb.layout import Layout, startup_layout
from services.worker.parallel.expert_moves import move_plan


def test_own_copies_stay_and_others_come_from_the_lowest_holder():
    old = startup_layout(8, 2, 2)  # slots 0-9: experts 0-7, then copies of 0 and 1; rank 1 holds 5, 6, 7, 0, 1
    new = Layout((7, 0, 3, 3, 5, 6, 1, 2, 4, 0), num_gpus=2, num_logical=8)
    # Rank 0 keeps 0 and 3 (3 twice), takes 7 and 5 from rank 1; rank 1 keeps 6, 1 and 0, takes 2 and 4 from rank 0.
    assert move_plan(old, new) == [[1, 0, 0, 0, 1], [1, 1, 0, 0, 1]]


def test_a_layout_over_other_ranks_is_refused():
    with pytest.raises(ValueError, match="cannot replace"):
        move_plan(startup_layout(8, 2, 0), startup_layout(8, 4, 0))
