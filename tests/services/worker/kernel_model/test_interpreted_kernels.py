"""The interpreted step set of ``--kernels interpreted``: the MoE path's, the norms' and attention's kernels run by
Triton's interpreter, the rest left to torch (None in the set), the interpreter on only inside the block, and the
CPU's batch-invariant torch maths inside it when asked."""

from __future__ import annotations

import os

from model.batch_invariant import active
from services.worker.kernel_model.interpreted_kernels import step_kernels


def test_the_step_set_interprets_the_moe_norms_and_attention_only_inside_its_block():
    before = os.environ.get("TRITON_INTERPRET")
    with step_kernels() as kernels:
        assert os.environ["TRITON_INTERPRET"] == "1" and kernels.interpreted
        assert not active()
        for name in ("rmsnorm", "quant_fp8", "moe_router", "moe_grouped_gemm", "decode_attention"):
            assert getattr(kernels, name).__name__ == f"_interpreted_kernels_{name}", name
        assert kernels.prefill_attention.__name__ == "_interpreted_kernels_prefill_attention"
        assert kernels.moe_fp4.__name__ == "_interpreted_kernels_moe_fp4"
        assert kernels.mhc is None and kernels.compressor is None and kernels.indexer is None
        assert kernels.sampler is None
    assert os.environ.get("TRITON_INTERPRET") == before
    with step_kernels(batch_invariant=True):
        assert active()
    assert not active()
