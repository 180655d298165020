"""The memory plan (services/engine/memory_plan.py): v41-s1's arithmetic on an H100-sized budget, and the clear
error naming what is needed, what is available and the flags that help."""

from __future__ import annotations

import pytest

from model.deepseek_v41.presets import preset
from services.engine.config import EngineConfig
from services.engine.memory_plan import GiB, NotEnoughMemory, check, estimate

H100_BYTES = 79 * GiB  # an 80 GB H100 as torch reports it (79.2 GiB)


def _config(**changes) -> EngineConfig:
    base = dict(
        device="cuda", kernel_backend="fp8", expert_format="fp4", cuda_graphs=True, max_model_len=4096, max_num_seqs=16
    )
    return EngineConfig(**{**base, **changes})


def test_v41_s1_fits_an_h100_with_fp4_experts_and_engram_tables_on_the_host():
    cfg = preset("v41-s1")
    plan = estimate(cfg, _config(engram_on_host=True))
    assert plan.engram_bytes == 0 and 35 * GiB < plan.engram_host_bytes < 45 * GiB  # two ~72M-row tables
    assert 30 * GiB < plan.expert_bytes < 40 * GiB  # 40 layers × 48 experts × 3 × 2304 × 5120 at 0.53 B
    check(plan, _config(engram_on_host=True), H100_BYTES, "v41-s1")  # fits: no error


@pytest.mark.parametrize(
    ("changes", "flags"),
    [
        ({}, ["--engram-on-host"]),
        ({"engram_on_host": True, "expert_format": "fp8"}, ["--expert-format fp4"]),
    ],
)
def test_a_model_that_does_not_fit_gets_the_clear_error(changes, flags):
    cfg = preset("v41-s1")
    config = _config(**changes)
    plan = estimate(cfg, config)
    with pytest.raises(NotEnoughMemory) as info:
        check(plan, config, H100_BYTES, "v41-s1")
    message = str(info.value)
    assert f"needs {plan.needed_bytes / GiB:.1f} GiB" in message
    assert f"{H100_BYTES * 0.9 / GiB:.1f} GiB are available" in message
    for flag in [*flags, "--max-num-seqs", "--max-model-len"]:
        assert flag in message
    assert "--engram-on-host" not in message or not config.engram_on_host


def test_fp4_experts_take_about_half_the_fp8_bytes():
    cfg = preset("v41-s1")
    fp4, fp8 = estimate(cfg, _config(expert_format="fp4")), estimate(cfg, _config(expert_format="fp8"))
    assert fp4.expert_bytes == fp8.expert_bytes_fp4
    assert 0.5 < fp4.expert_bytes / fp8.expert_bytes < 0.55  # (0.5 + 1/32) / (1 + 1/4096)


def test_the_llm_refuses_before_loading_with_a_fake_device(monkeypatch):
    """``LLM`` plans before it loads: a fake 24 GiB CUDA device refuses v41-s1 with the clear error, and nothing is
    loaded (the loader is never reached)."""
    import torch

    from services.engine import llm as llm_module

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (24 * GiB, 24 * GiB))
    config = _config(engram_on_host=True)
    with pytest.raises(NotEnoughMemory, match=r"24\.0 GiB × gpu_memory_utilization"):
        llm_module.plan_memory("v41-s1", config)


def test_a_dummy_load_plans_from_a_directory_of_config_and_tokenizer_only(monkeypatch, tmp_path):
    """``load_format="dummy"`` reads only a directory's config and tokenizer, the memory plan included: a
    directory without weight files plans (and here refuses on a fake 24 GiB device) instead of failing on the
    missing safetensors."""
    import json

    import torch

    from model.deepseek_v41.config import to_hf_dict
    from model.deepseek_v41.tokenizer import write_tokenizer_files
    from services.engine import llm as llm_module

    write_tokenizer_files(tmp_path, None)
    (tmp_path / "config.json").write_text(json.dumps(to_hf_dict(preset("v41-s1"))))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (24 * GiB, 24 * GiB))
    with pytest.raises(NotEnoughMemory, match=r"24\.0 GiB × gpu_memory_utilization"):
        llm_module.plan_memory(str(tmp_path), _config(engram_on_host=True, load_format="dummy"))
