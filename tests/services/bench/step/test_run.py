"""`shinkai bench step` on CPU with the tiny model: every section runs and writes its JSON and table."""

import json

import pytest

from model.deepseek_v41.presets import V41_S1, preset
from services.bench.step.build import KINDS_OF_V41, subset_config
from services.entrypoints.cli import main


def test_cpu_run_writes_json_and_markdown(tmp_path, one_torch_thread):
    out, md = tmp_path / "step.json", tmp_path / "step.md"
    assert main(["bench", "step", "--no-compare", "--profile", "--json", str(out), "--markdown", str(md)]) == 0
    result = json.loads(out.read_text())  # (main pins 1 thread)
    sections = {r["section"] for r in result["rows"]}
    assert {"host", "decode", "decode fit", "prefill", "offline", "profile"} <= sections
    profiles = [r for r in result["rows"] if r["section"] == "profile"]
    assert [r["batch"] for r in profiles] == [1, 4, 1] and profiles[-1]["prefill_tokens"] == 32
    assert all(r["launches_per_step"] == 0 and r["kernel_ms"] == 0 for r in profiles)  # no device events on CPU
    assert "0 kernel launches per step" in md.read_text()
    decode = [r for r in result["rows"] if r["section"] == "decode"]
    assert [r["batch"] for r in decode] == [1, 4] and all(r["ms"] > 0 for r in decode)
    assert {r["async"] for r in result["rows"] if r["section"] == "offline"} == {False, True}
    assert "| 64 | 4 |" in md.read_text()


def test_subset_keeps_every_kind_of_v41_layer():
    cfg = subset_config(V41_S1, KINDS_OF_V41, 40_000)
    assert cfg.num_hidden_layers == 8
    assert cfg.compress_ratios[:8] == (0, 0, 2, 2, 2, 1, 1, 1)
    assert cfg.kv_source_layer_ids == (2, 4, 5) and cfg.index_source_layer_ids == (2, 4, 5, 7)
    assert cfg.candidate_source_layer_id == 5 and cfg.uses_candidates(7)
    assert cfg.engram_layer_ids == (1, 4) and max(cfg.engram_num_embeddings) < 1_100_000
    with pytest.raises(ValueError):
        subset_config(V41_S1, [3, 2])


def test_a_subset_keeps_the_draft_only_with_every_layer_it_taps():
    tiny = preset("tiny")  # a DSpark draft tapping layers 5, 6 and 7
    kept = subset_config(tiny, [0, 5, 6, 7])
    assert kept.num_nextn_predict_layers == tiny.num_nextn_predict_layers and kept.dspark_target_layer_ids == (1, 2, 3)
    cut = subset_config(tiny, range(4))  # bench step --model tiny --layers 4 (the draft's layers gone)
    assert cut.num_hidden_layers == 4 and cut.num_nextn_predict_layers == 0


def test_sizes_from_the_command_line_replace_the_modes(tmp_path, one_torch_thread):
    out = tmp_path / "step.json"
    assert (
        main(
            [
                "bench",
                "step",
                "--no-compare",
                "--no-async",
                "--batches",
                "2",
                "--contexts",
                "48",
                "--prefill-tokens",
                "16",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())["rows"]
    assert [(r["batch"], r["context"]) for r in rows if r["section"] == "decode"] == [(2, 48)]
    assert not any(r["section"] == "decode fit" for r in rows)  # one batch size: no line to fit
    assert [r["tokens"] for r in rows if r["section"] == "prefill"] == [16]
    assert "--batches 2" in json.loads(out.read_text())["command"]


@pytest.mark.parametrize("bad", [["--batches", "1,x"], ["--contexts", "0"]])
def test_bad_sizes_are_refused_with_a_message(bad, capsys):
    with pytest.raises(SystemExit, match="comma-separated integers|must be positive"):
        main(["bench", "step", "--no-compare", "--no-async", *bad])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal is the CPU's")
def test_the_ep_path_comparison_needs_a_gpu():
    """`bench step --dp 1 --ep-path` (services/bench/step/ep_path.py) runs on a GPU; on the CPU it says so."""
    with pytest.raises(SystemExit, match="--ep-path runs on a GPU"):
        main(["bench", "step", "--dp", "1", "--ep-path"])
