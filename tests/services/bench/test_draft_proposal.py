"""`python -m services.bench.draft_proposal` on the CPU, small: it finds the proposals, counts their ops per
part, and the only host read it sees in a proposal outside the stages is the speculator's one read of the
drafts and confidences (a read added to the slot loop fails here)."""

from __future__ import annotations

import argparse
import json

import torch

from services.bench import draft_proposal


def test_the_proposal_reads_once_and_its_ops_are_counted(tmp_path, capsys, draft_checkpoint):
    path = draft_checkpoint
    parser = argparse.ArgumentParser()
    draft_proposal.add_arguments(parser)
    args = parser.parse_args(["--model", str(path), "--device", "cpu", "--batch", "2", "--max-tokens", "3",
                              "--prompt-len", "6", "--batch-invariant",
                              "--json", str(tmp_path / "counts.json")])
    threads = torch.get_num_threads()
    try:
        assert draft_proposal.main(args) == 0
    finally:
        torch.set_num_threads(threads)
    counts = json.loads((tmp_path / "counts.json").read_text())
    assert counts["proposals"] > 0
    assert all(counts["aten_ops_per_proposal"][part] > 0 for part in ("draft.inputs", "draft.stages", "draft.slots"))
    reads = {site: n for site, n in counts["host_reads_per_proposal"].items() if "moe.py" not in site}
    assert len(reads) == 1 and next(iter(reads)).startswith("tolist @ speculator.py") and set(reads.values()) == {1}
    # Built from Python data on the host only (then copied non-blocking): the inputs and rejection's draws.
    assert {site.split(" @ ")[1].split(":")[0] for site in counts["host_builds_per_proposal"]} <= {
        "draft_proposal.py", "philox.py"}
    print(capsys.readouterr().out)
