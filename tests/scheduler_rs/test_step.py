import numpy as np
import torch

from scheduler_rs import Scheduler, graph_sizes, select_graph_size
from tests.scheduler_rs.configs import scheduler_config


def test_graph_sizes_for_24_and_384_rows():
    assert graph_sizes(4 * 6) == [1, 2, 4, 8, 16, 24]
    sizes = graph_sizes(64 * 6)
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 384
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))
    assert select_graph_size(sizes, 37) == 40
    assert select_graph_size(sizes, 385) is None
    assert scheduler_config(max_num_seqs=4, nextn=5).graph_sizes == [1, 2, 4, 8, 16, 24]


def test_plan_arrays_are_buffers_without_copies():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4))
    scheduler.add_request("a", [5, 6, 7, 8, 9], max_tokens=2)
    scheduler.add_request("b", [5, 6], max_tokens=2)
    plan = scheduler.schedule()
    positions = np.frombuffer(plan.positions, dtype=np.int32)
    assert positions.tolist() == [0, 1, 2, 3, 4, 0, 1]
    assert memoryview(plan.input_ids).format == "i"
    assert torch.frombuffer(bytearray(plan.input_ids), dtype=torch.int32).tolist() == [5, 6, 7, 8, 9, 5, 6]
    assert plan.query_start.tolist() == [0, 5, 7]
    assert plan.row_requests.tolist() == [0] * 5 + [1] * 2
    tables = np.frombuffer(plan.block_tables, dtype=np.int32).reshape(plan.num_requests, plan.block_table_width)
    assert tables[1, 1] == 0  # padded with the null block
    assert plan.sample_rows.tolist() == [4, 6]


def test_entry_writes_follow_the_compress_ratio():
    scheduler = Scheduler(scheduler_config(block_size=4, num_blocks=16, num_state_slots=4, compress_ratios=[2, 1]))
    scheduler.add_request("a", list(range(10, 16)), max_tokens=2)
    plan = scheduler.schedule()
    table = scheduler.request("a").block_table
    rows, slots = plan.entry_writes(2)
    # Ratio 2: entries complete at odd positions; entry e lives in block e // 2 at offset e % 2.
    assert rows.tolist() == [1, 3, 5]
    assert slots.tolist() == [table[0] * 2 + 0, table[0] * 2 + 1, table[1] * 2 + 0]
    rows, slots = plan.entry_writes(1)
    assert rows.tolist() == list(range(6))
    assert slots.tolist() == [table[p // 4] * 4 + p % 4 for p in range(6)]
