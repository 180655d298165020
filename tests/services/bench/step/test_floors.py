"""The step floors reproduce the target specification's decode table from the model's own tensor table."""

import pytest

from model.deepseek_v41.presets import TINY, V41_S1
from services.bench.step.floors import SPEC_FLOORS_MS, expected_active_experts, step_cost

SPEC_CEILINGS = {"bandwidth": 4.26e12, "fp8_peak": 1440e12, "bf16_peak": 720e12}


@pytest.mark.parametrize("batch", [1, 16, 64, 256])
def test_decode_floor_matches_the_specification_table(batch):
    ours = step_cost(V41_S1, batch, 4096, prefill=False).floor(SPEC_CEILINGS) * 1e3
    assert ours == pytest.approx(SPEC_FLOORS_MS[("decode", batch)], rel=0.05)


@pytest.mark.parametrize("tokens", [4096, 32768])
def test_prefill_floor_is_compute_bound_and_near_the_issue_table(tokens):
    cost = step_cost(V41_S1, tokens, tokens, prefill=True)
    ours = cost.floor(SPEC_CEILINGS) * 1e3
    # Ours counts attention at the bf16 peak (its MMAs are bf16), so it sits a little above the specification's.
    assert SPEC_FLOORS_MS[("prefill", tokens)] <= ours <= 1.15 * SPEC_FLOORS_MS[("prefill", tokens)]
    assert cost.total_flops() / SPEC_CEILINGS["fp8_peak"] > cost.total_bytes() / SPEC_CEILINGS["bandwidth"]


def test_expected_active_experts():
    assert expected_active_experts(1, 48, 6) == pytest.approx(6)
    assert expected_active_experts(16, 48, 6) == pytest.approx(48 * (1 - (42 / 48) ** 16))
    assert expected_active_experts(10_000, 48, 6) == pytest.approx(48)


def test_floor_grows_with_batch_and_context():
    floors = [step_cost(TINY, b, 64, prefill=False).floor(SPEC_CEILINGS) for b in (1, 8, 64)]
    assert floors == sorted(floors) and floors[0] < floors[-1]
    assert step_cost(V41_S1, 64, 32768, prefill=False).floor(SPEC_CEILINGS) > step_cost(
        V41_S1, 64, 4096, prefill=False
    ).floor(SPEC_CEILINGS)


def test_fp4_experts_floor_counts_half_a_byte_and_a_scale_per_32_weights():
    from model.deepseek_v41.presets import preset
    from services.bench.step.floors import step_cost

    cfg = preset("v41-s1")
    fp8, fp4 = (step_cost(cfg, 1, 4096, prefill=False, expert_format=f) for f in ("fp8", "fp4"))
    experts8 = sum(op.bytes for op in fp8.ops if op.name.startswith("experts "))
    experts4 = sum(op.bytes for op in fp4.ops if op.name.startswith("experts "))
    assert experts4 / experts8 == pytest.approx((0.5 + 1 / 32) / (1 + 4 / (128 * 128)), rel=1e-12)
    others = [op.bytes for op in fp8.ops if not op.name.startswith("experts ")]
    assert others == [op.bytes for op in fp4.ops if not op.name.startswith("experts ")]
