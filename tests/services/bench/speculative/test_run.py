"""`shinkai bench speculative` on the CPU, small: every case runs, forced acceptance is what the counters say
(a = 1: every verified draft accepted; a = 0: none), and varlen at a = 0 verifies no draft once its
step-cost curve is measured. Speeds are printed, never asserted."""

from __future__ import annotations

import json

from services.bench.speculative import run as speculative
from tests.services.bench.conftest import run_main


def test_every_case_runs_and_forced_acceptance_holds(tmp_path, capsys, draft_checkpoint):
    path = draft_checkpoint
    run_main(
        speculative,
        [
            "--model",
            str(path),
            "--device",
            "cpu",
            "--batch",
            "3",
            "2",
            "--acceptance",
            "0",
            "1",
            "--max-tokens",
            "8",
            "--prompt-len",
            "6",
            "--block-size",
            "8",
            "--json",
            str(tmp_path / "spec.json"),
        ],
    )
    results = json.loads((tmp_path / "spec.json").read_text())["results"]
    # One engine a mode: off at every batch, then each mode at every batch and a (the counters are deltas, so a
    # later case on the same engine reports only its own drafts: a = 0 after a = 1 accepts none).
    assert [(r["batch"], r["mode"], r["acceptance"]) for r in results] == [(3, "off", None), (2, "off", None)] + [
        (b, m, a) for m in ("fixed", "varlen") for b in (3, 2) for a in (0.0, 1.0)
    ]
    for r in results:
        assert r["output_tokens"] == r["batch"] * 8
        if r["mode"] == "off":
            assert r["drafts_verified"] == 0 and r["speedup_vs_off"] == 1.0
        elif r["acceptance"] == 1.0:
            assert r["drafts_accepted"] == r["drafts_verified"] > 0
        else:
            assert r["drafts_accepted"] == 0
            if r["mode"] == "fixed":
                assert r["drafts_verified"] > 0
        # Where a step's time goes: every field present; the CPU runner (no DecodeStepGraphs) has no graph counters.
        assert r["worker_steps"] > 0 and r["worker_ms_per_step"] > 0
        assert r["eager_steps"] is None and r["graph_replays"] is None
        if r["mode"] == "off":
            assert r["spec_ms_per_step"] is None and r["draft_graph_captures"] is None
        else:
            assert r["spec_steps"] == r["worker_steps"]  # every step of the timed run went through the speculator
            ms = r["spec_ms_per_step"]
            assert set(ms) == {"sample", "verify", "propose", "read", "other", "total"} and ms["total"] > 0
            assert r["draft_graph_captures"] is None  # the eager proposal: no DraftProposalGraphs
    # Varlen at a = 0: the forced chances are 0, so no draft is worth a row: it verifies none at all, and its
    # back-off skips proposals (every other step from the second at the least); fixed mode never skips one.
    for r in results:
        if r["mode"] == "varlen" and r["acceptance"] == 0.0:
            assert r["drafts_verified"] == 0 and r["proposals_skipped"] > 0
        else:
            assert r["proposals_skipped"] == 0
        if r["mode"] == "varlen":  # the curves it chose from, per request bucket: sizes measured, times positive
            means = r["step_cost_means"]
            assert means and all(ms > 0 and n > 0 for sizes in means.values() for ms, n in sizes.values())
            assert str(r["batch"]) in means or any(int(b) >= r["batch"] for b in means)
        else:
            assert r["step_cost_means"] is None
    print(capsys.readouterr().out)


def test_the_static_proposal_sees_no_new_key_in_the_timed_run(tmp_path):
    """With the static proposal (what ``--cuda-graphs`` captures) every greedy bucket up to the batch is built
    before the warm-up, so the timed run never builds (on a GPU: captures) one; a = 0.8 ends requests at different
    steps, so fewer of them propose at the end."""
    run_main(
        speculative,
        [
            "--device",
            "cpu",
            "--batch",
            "3",
            "--acceptance",
            "0.8",
            "--modes",
            "fixed",
            "--max-tokens",
            "8",
            "--prompt-len",
            "6",
            "--block-size",
            "8",
            "--static-proposal",
            "--profile",
            "--json",
            str(tmp_path / "spec.json"),
        ],
    )
    off, fixed = json.loads((tmp_path / "spec.json").read_text())["results"]
    # --profile: a short extra run per case after the timed one (on the CPU the profiler sees no device kernels)
    for r in (off, fixed):
        assert r["profile"]["steps"] >= 8 // (1 + 5) and r["profile"]["wall_ms"] > 0 and r["profile"]["kernels"] == []
    assert off["draft_keys"] is None and (fixed["draft_keys"], fixed["draft_keys_timed"]) == (3, 0)  # 1, 2 and 4
    assert fixed["draft_graph_captures"] == 0  # no graphs on the CPU
