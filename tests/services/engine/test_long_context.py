"""A prompt past 65,536 tokens (positions beyond YaRN's original length, block tables of 500+ blocks, a dozen
prefill chunks) through the engine on a two-layer config, against the full forward: in batch-invariant mode the
logits of every sampled row equal the reference's under ``==``.

The config's layers attend through the sliding window only (ratio 0): the reference forward's indexer scores of a
compressed layer are [S, S / 2] floats, about 9 GB at this length, beyond a CPU test. The compressed layers' YaRN
positions are covered at the oracle's lengths (tests/services/worker/runners/test_model_runner.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.batch_invariant import batch_invariant
from model.deepseek_v41.init import random_checkpoint
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.model import DeepseekV41
from services.engine import LLM, SamplingParams
from services.engine.model_source import ModelSource
from tests.model.deepseek_v41.oracle_configs import ORACLE
from tests.model.deepseek_v41.oracle_harness import toy_tokenizer

PROMPT_LEN = 66_000
NUM_TOKENS = 3

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class Recording:
    def __init__(self, sampler) -> None:
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits, rows, *counts):
        self.logits.append(logits.float().clone())
        return self.sampler(logits, rows, *counts)


def test_a_prompt_past_65536_tokens_equals_the_full_forward():
    cfg = dataclasses.replace(
        ORACLE,
        num_hidden_layers=2,
        hidden_size=32,
        compress_ratios=(0, 0),
        kv_source_layer_ids=(),
        index_source_layer_ids=(),
        candidate_source_layer_id=None,
        engram_layer_ids=(),
        engram_num_embeddings=(),
    )
    assert PROMPT_LEN > cfg.rope_scaling.original_max_position_embeddings
    model = DeepseekV41(cfg)
    assign_weights(model, random_checkpoint(cfg, 5))
    model.eval()
    source = ModelSource("long", cfg, model, toy_tokenizer(cfg.vocab_size))
    llm = LLM(
        source=source,
        block_size=128,
        max_model_len=PROMPT_LEN + NUM_TOKENS,
        max_num_seqs=1,
        max_num_batched_tokens=6_000,
        batch_invariant=True,
    )
    prompt = torch.randint(3, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    recording = Recording(llm.engine.worker.sampler)
    llm.engine.worker.sampler = recording
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True))
    assert len(out.token_ids) == NUM_TOKENS == len(recording.logits)
    fed = prompt + out.token_ids[:-1]
    with torch.no_grad(), batch_invariant():
        reference = model(torch.tensor([fed]))[0]
    for k, logits in enumerate(recording.logits):
        position = PROMPT_LEN - 1 + k
        assert torch.equal(logits[0], reference[position].float()), position
        assert out.token_ids[k] == int(torch.argmax(reference[position]))
