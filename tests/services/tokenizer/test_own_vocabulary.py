"""A checkpoint without DeepSeek's vocabulary uses its own tokenizer files, offline and in the
tokenizer service."""

import pytest

from model.deepseek_v41.init import write_random_checkpoint
from model.deepseek_v41.tokenizer import engram_token_map
from services.engine import LLM, SamplingParams
from services.tokenizer.service import load_vocabulary
from tests.model.deepseek_v41.oracle_configs import ORACLE, finish
from tests.model.deepseek_v41.oracle_harness import toy_tokenizer


@pytest.fixture(scope="module")
def toy_checkpoint(tmp_path_factory):
    tokenizer = toy_tokenizer(ORACLE.vocab_size)
    _, num_compressed = engram_token_map(tokenizer)
    out = tmp_path_factory.mktemp("toy")
    write_random_checkpoint(out, finish(ORACLE, num_compressed), seed=5, tokenizer=tokenizer)
    return out, tokenizer


def test_llm_encodes_and_decodes_with_the_checkpoints_vocabulary(toy_checkpoint):
    path, tokenizer = toy_checkpoint
    llm = LLM(model=str(path), block_size=16)
    out = llm.generate("the cat sat on the mat", SamplingParams(max_tokens=5, seed=2, ignore_eos=True))[0]
    words = tokenizer.encode("the cat sat on the mat").ids
    assert out.prompt_token_ids == [0, *words]  # BOS, then the toy WordLevel ids
    assert all(t < 256 for t in out.token_ids) and len(out.token_ids) == 5
    assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_tokenizer_service_loads_the_checkpoints_files(toy_checkpoint):
    path, tokenizer = toy_checkpoint
    loaded, bos = load_vocabulary(str(path))
    assert loaded.get_vocab_size() == 256 and bos == 0
    assert loaded.encode("naïve dog").ids == tokenizer.encode("naïve dog").ids
