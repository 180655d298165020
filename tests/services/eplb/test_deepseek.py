"""The `deepseek` policy against deepseek-ai/EPLB's reference: its README example and golden outputs.

The goldens come from ``scripts/dev/eplb_deepseek_golden.py`` running the reference at a pinned commit. The
reference breaks ties by unstable sorts, so placements may differ where loads tie; the balance on the
summed load may not (to 1e-9).
"""

import json
import pathlib

import numpy as np
import pytest

from services.eplb.compare import Case, load_digest
from services.eplb.deepseek import DeepSeekShapeError, deepseek_plan
from services.eplb.guarded import PlanConfig, plan
from services.eplb.layout import Layout, moe_lb, startup_layout

GOLDEN = json.loads((pathlib.Path(__file__).parent / "data/deepseek_golden.json").read_text())

# The reference README's example and its printed output (2 layers, 12 experts, 16 replicas, 4 groups,
# 2 nodes, 8 GPUs).
README_WEIGHT = [
    [90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
    [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27],
]
README_PHY2LOG = [
    [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
    [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
]


def golden_load(case: dict) -> np.ndarray:
    """The case's summed load (1 × experts), checked against the digest the golden was made from."""
    if "weight" in case:
        return np.array([case["weight"]], dtype=np.float64)
    summed = Case(*case["case"]).window().sum(axis=0)
    assert load_digest(summed) == case["load_sha256"], f"{case['name']}: the seeded load generator changed"
    return summed[None, :].astype(np.float64)


@pytest.mark.parametrize("layer", [0, 1])
def test_readme_example_is_reproduced_exactly(layer):
    layout = deepseek_plan(np.array([README_WEIGHT[layer]]), 8, 16, num_groups=4, num_nodes=2)
    assert list(layout.phy2log) == README_PHY2LOG[layer]


def test_goldens_cover_global_and_hierarchical_cases():
    assert GOLDEN["commit"] == "d52c72d5b2f2fb4c41afbf8eb21366820239913d"
    kinds = {(c["num_groups"], c["num_nodes"]) for c in GOLDEN["cases"]}
    assert {(1, 1), (4, 2), (8, 2), (8, 8)} <= kinds
    assert sum(c["num_groups"] == 1 for c in GOLDEN["cases"]) == 160  # 40 per comparison shape


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_balance_on_the_summed_load_equals_the_reference(case):
    load = golden_load(case)
    reference = Layout(tuple(case["phy2log"]), case["num_gpus"], load.shape[1])
    ours = deepseek_plan(
        load, case["num_gpus"], case["num_slots"], num_groups=case["num_groups"], num_nodes=case["num_nodes"]
    )
    assert ours.copies().sum() == reference.copies().sum()
    assert abs(moe_lb(load, ours) - moe_lb(load, reference)) <= 1e-9


def test_minimal_case_gives_1_32_in_deepseek_and_deepinfer_modes():
    load = np.array([[1, 100, 100, 1]])
    current = startup_layout(4, 4, 4)
    for policy in ("deepseek", "deepinfer"):
        result = plan(load, current, PlanConfig(policy=policy))
        assert result.moe_lb_after == pytest.approx((200 / 3) / (202 / 4), abs=1e-12)  # 1.3201
        assert result.layout.copies().tolist() == [1, 3, 3, 1]


def test_unequal_groups_fall_back_to_the_global_policy_as_the_reference_does():
    load = np.array([README_WEIGHT[0]])
    assert deepseek_plan(load, 8, 16, num_groups=3, num_nodes=2) == deepseek_plan(load, 8, 16)


@pytest.mark.parametrize(
    "num_gpus,num_slots,groups,nodes,message",
    [
        (8, 16, 5, 5, "do not split into 5 groups"),
        (6, 18, 4, 4, "6 GPUs do not split over 4 nodes"),
        (8, 20, 1, 1, "20 slots do not divide over 8 GPUs"),
        (8, 16, 0, 1, "num_groups must be ≥ 1"),
    ],
)
def test_shapes_the_reference_asserts_against_are_clear_errors(num_gpus, num_slots, groups, nodes, message):
    with pytest.raises(DeepSeekShapeError, match=message):
        deepseek_plan(np.array([README_WEIGHT[0]]), num_gpus, num_slots, num_groups=groups, num_nodes=nodes)
