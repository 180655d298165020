"""The layer-by-layer build of models too large for fp32 (v41-s1), checked on the tiny preset."""

import pytest
import torch

from model.deepseek_v41.init import random_stored_on_device
from model.deepseek_v41.loader import assign_weights
from model.deepseek_v41.model import DeepseekV41
from model.deepseek_v41.presets import TINY
from model.deepseek_v41.quant import dequantize_fp8_rowwise, quantize_fp8_rowwise
from model.deepseek_v41.tokenizer import engram_token_map, load_v41_tokenizer
from services.worker.kernel_model.gpu_model import Fp8RowwiseEmbedding, build_random_kernel_model


@pytest.fixture(scope="module")
def token_map(one_torch_thread):
    return engram_token_map(load_v41_tokenizer())


def test_fp8_rowwise_embedding_equals_the_dequantised_table():
    w = torch.randn(50, 64)
    q, s = quantize_fp8_rowwise(w)
    rows = torch.tensor([[3, 0, 49], [7, 7, 1]])
    out = Fp8RowwiseEmbedding(q, s)(rows)
    assert out.shape == (2, 3, 64)
    assert torch.equal(out, dequantize_fp8_rowwise(q, s)[rows])


def test_layer_by_layer_build_equals_the_whole_model_build(token_map):
    tm, nc = token_map
    streamed = build_random_kernel_model(
        TINY, 5, "cpu", token_map=torch.as_tensor(tm), num_compressed=nc, convert=False
    )
    tensors = {}
    for entry in random_stored_on_device(TINY, 5, "cpu"):
        tensors.update(entry)
    whole = DeepseekV41(TINY, tm, nc)
    assign_weights(whole, tensors)
    assert not any(p.is_meta for p in streamed.parameters())
    assert all(isinstance(b.engram.embed, Fp8RowwiseEmbedding) for b in streamed.layers if b.engram is not None)
    ids = torch.randint(3, TINY.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(streamed(ids), whole.eval()(ids))
