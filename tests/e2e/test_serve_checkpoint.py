"""`shinkai up --model DIR` on a `shinkai model init --preset tiny` directory: greedy tokens through HTTP
(plain and streamed) equal `LLM(model=DIR)`'s, and `down` stops everything.

Both sides run in the batch-invariant mode: the offline side decodes the prompts as one batch and the
served side one at a time, and outside the mode a random tiny model's near-ties can flip between batch
shapes on some CPUs (they did on an AVX-512 Zen CPU: the greedy tokens differed from the third on)."""

import json

import openai
import pytest

from services.engine import LLM, SamplingParams
from services.entrypoints.cli import main
from services.entrypoints.probe import alive_as
from tests.service_logs import ready_event

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["The capital of France is", "1, 2, 3,"]


def test_a_checkpoint_directory_serves_the_offline_tokens(tmp_path, capsys):
    ckpt = tmp_path / "tiny"
    assert main(["model", "init", "--preset", "tiny", "--out", str(ckpt), "--seed", "3"]) == 0
    run_dir = tmp_path / "run"
    assert (
        main(
            [
                "up",
                "--model",
                str(ckpt),
                "--run-dir",
                str(run_dir),
                "--http-port",
                "0",
                "--grpc-port",
                "0",
                "--max-num-seqs",
                "4",
                "--device",
                "cpu",
                "--batch-invariant",
            ]
        )
        == 0
    ), capsys.readouterr().err
    state = json.loads((run_dir / "stack.json").read_text())
    try:
        gateway = next(s for s in state["services"] if s["name"] == "gateway")
        engine = next(s for s in state["services"] if s["name"] == "engine-0")
        assert engine["argv"][engine["argv"].index("--model") + 1] == str(ckpt)
        assert engine["argv"][engine["argv"].index("--device") + 1] == "cpu"
        ready = ready_event(gateway["log"])
        client = openai.OpenAI(base_url=ready["http"] + "/v1", api_key="unused", max_retries=0, timeout=60)
        llm = LLM(model=str(ckpt), device="cpu", batch_invariant=True)
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        expected = llm.generate(PROMPTS, params)
        assert len({out.text for out in expected}) == len(PROMPTS)  # the prompts lead apart: a real comparison
        for prompt, want in zip(PROMPTS, expected):
            plain = client.completions.create(
                model=str(ckpt), prompt=prompt, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True}
            )
            streamed = client.completions.create(
                model=str(ckpt),
                prompt=prompt,
                max_tokens=6,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            assert plain.choices[0].text == want.text
            assert "".join(c.choices[0].text for c in streamed) == want.text
            assert plain.usage.completion_tokens == len(want.token_ids) == 6
    finally:
        assert main(["down", "--run-dir", str(run_dir), "--timeout", "30"]) == 0
    assert not any(alive_as(s["pid"], s["argv"]) for s in state["services"])
