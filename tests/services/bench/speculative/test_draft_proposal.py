"""`python -m services.bench.speculative.draft_proposal` on the CPU, small: it finds the proposals, counts their ops per
part, and the only host read it sees in a speculative step outside the stages' torch MoE is the speculator's
one read of the verdicts, drafts and confidences (a read added to the verification or the slot loop fails
here); the speculative code builds nothing from Python data straight onto the device."""

from __future__ import annotations

import json

from services.bench.speculative import draft_proposal
from tests.services.bench.conftest import run_main


def test_the_proposal_reads_once_and_its_ops_are_counted(tmp_path, capsys, draft_checkpoint):
    path = draft_checkpoint
    run_main(
        draft_proposal,
        [
            "--model",
            str(path),
            "--device",
            "cpu",
            "--batch",
            "2",
            "--max-tokens",
            "3",
            "--prompt-len",
            "6",
            "--batch-invariant",
            "--json",
            str(tmp_path / "counts.json"),
        ],
    )
    counts = json.loads((tmp_path / "counts.json").read_text())
    assert counts["proposals"] > 0
    assert all(counts["aten_ops_per_proposal"][part] > 0 for part in ("draft.inputs", "draft.stages", "draft.slots"))
    reads = {site: n for site, n in counts["host_reads_per_step"].items() if "moe.py" not in site}
    assert len(reads) == 1 and next(iter(reads)).startswith("tolist @ speculator.py") and set(reads.values()) == {1}
    # The speculative code builds host tensors and copies them non-blocking (the sampler's own builds are the
    # worker's sampler, counted here but not this code's).
    speculative = (
        "speculator.py",
        "verifier.py",
        "draft_proposal.py",
        "static_draft_proposal.py",
        "accepted_context.py",
    )
    assert not [site for site in counts["device_builds_per_step"] if site.split(" @ ")[1].startswith(speculative)]
    print(capsys.readouterr().out)
