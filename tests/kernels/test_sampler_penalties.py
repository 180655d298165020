"""The sampler kernel's penalties and min-p (its pass 0) against the CPU sampler: interpreted on CPU, compiled on a
GPU; every row alone gives the bits it gives in the batch (the batch-invariant mode's contract)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

from kernels.interpret import interpreter, load_interpreted
from services.worker.sampling.sampler import Sampler, SamplingRow
from services.worker.sampling.token_counts import TokenCounts
from tests.kernels.test_sampler import _check

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(vocab: int) -> list[SamplingRow]:
    """Every parameter alone and together, greedy and drawn, with and without top-k / top-p and top-n."""
    base = dict(top_k=-1, top_p=1.0, position=9, forced_top_k=None, banned_token_ids=(), num_logprobs=0)
    specs = [
        dict(temperature=1.0, presence_penalty=1.5, history=0),
        dict(temperature=0.0, frequency_penalty=2.0, history=1),
        dict(temperature=0.8, repetition_penalty=1.7, history=2),
        dict(temperature=1.0, repetition_penalty=0.6, frequency_penalty=-0.75, presence_penalty=0.5, history=3),
        dict(temperature=1.0, min_p=0.05),
        dict(temperature=0.0, min_p=0.3, num_logprobs=4),
        dict(temperature=0.7, min_p=0.1, top_p=0.9, top_k=50, presence_penalty=0.4, history=0, num_logprobs=3),
        dict(temperature=1.3, banned_token_ids=(3, 4), frequency_penalty=0.3, min_p=0.02, history=2),
        dict(temperature=1.0),  # neither: copied through pass 0 unchanged
    ]
    return [SamplingRow(seed=100 + i, **{**base, **spec}) for i, spec in enumerate(specs)]


def _problem(vocab: int, device: str = "cpu") -> tuple[torch.Tensor, list[SamplingRow], TokenCounts]:
    gen = torch.Generator().manual_seed(5)
    rows = _rows(vocab)
    logits = (torch.randn(len(rows), vocab, generator=gen) * 3).to(device)
    counts = TokenCounts(vocab, device, num_slots=4)
    for slot in range(4):
        prompt = torch.randint(0, vocab, (20,), generator=gen).tolist()
        counts.open(slot, prompt)
        # Outputs so far: a few repeats, so counts above 1 weigh.
        history = torch.randint(0, vocab // 4, (60,), generator=gen).to(device)
        counts.record([slot] * 60, history)
    return logits, rows, counts


def _interpreted(logits, rows, counts, block):
    k = load_interpreted("sampler")
    width = max(r.num_logprobs for r in rows)
    with interpreter():
        return k.sample(logits, k.sampling_tensors(rows), width, block=block, counts=(counts.output, counts.prompt))


def test_interpreted_kernel_penalties_and_min_p_match_the_cpu_sampler():
    logits, rows, counts = _problem(700)
    ref = Sampler()(logits, rows, counts)
    _check(ref, _interpreted(logits, rows, counts, block=128))


def test_interpreted_kernel_rows_alone_give_their_batch_bits():
    logits, rows, counts = _problem(300)
    batch = _interpreted(logits, rows, counts, block=64)
    for i in (0, 3, 5, 8):
        alone = _interpreted(logits[i : i + 1], rows[i : i + 1], counts, block=64)
        assert torch.equal(alone.token_ids, batch.token_ids[i : i + 1])
        assert torch.equal(alone.logprobs, batch.logprobs[i : i + 1])
        w = alone.top_logprobs.shape[1]
        assert torch.equal(alone.top_logprobs, batch.top_logprobs[i : i + 1, :w])


def test_interpreted_kernel_without_the_parameters_differs():
    """Dropping each row's penalties and min-p changes its outputs: the kernel applies them."""
    logits, rows, counts = _problem(300)
    with_them = _interpreted(logits, rows, counts, block=64)
    plain = [
        dataclasses.replace(r, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0)
        for r in rows
    ]
    without = _interpreted(logits, plain, counts, block=64)
    changed = (with_them.logprobs != without.logprobs).tolist()
    assert changed[:8] == [True] * 8 and changed[8] is False


def lower_for_hopper(process: bool) -> None:
    """The sampler kernel lowered to Triton IR for sm_90 (the code generator's checks), no GPU needed."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    import kernels.sampler as k

    fn = k._sampler_kernel
    pointers = dict(
        logits_ptr="*bf16", temp_ptr="*fp32", rank_limit_ptr="*i32", mass_limit_ptr="*i64", seed_ptr="*i64",
        pos_ptr="*i64", ban_ptr="*i32", forced_ptr="*i64", history_ptr="*i32", penalty_ptr="*fp64",
        min_p_ptr="*fp32", counts_ptr="*i32", prompt_ptr="*u8", scratch_ptr="*fp32", token_ptr="*i64",
        logprob_ptr="*fp32", error_ptr="*i1", top_ids_ptr="*i64", top_lp_ptr="*fp32", mask_ptr="*i32",
    )  # fmt: skip
    constants = dict(
        NUM_BANS=2, BLOCK=1024, NUM_CHUNKS=127, SEL_BLOCK=256, GROUP=8, GROUPS_POW2=16, NUM_TOP=4, TOP_POW2=4,
        PROCESS=process, HAS_MASK=process, LIBDEVICE=True,
    )  # fmt: skip
    signature = {name: pointers.get(name, "constexpr" if name in constants else "i32") for name in fn.arg_names}
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source = ASTSource(fn, signature, constants)
    module = source.make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context
    )
    assert "tt.func" in str(module)


@pytest.mark.parametrize("process", [False, True])
def test_the_kernel_passes_the_gpu_compilers_front_end(process):
    """The interpreter runs Python, so it accepts what Triton's code generator refuses (a name rebound to another
    type across branches): the kernel is lowered for Hopper on the CPU, as a GPU run would. In a fresh process: the
    interpreted runs leave triton.language patched for the interpreter."""
    code = f"from tests.kernels.test_sampler_penalties import lower_for_hopper; lower_for_hopper({process})"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def _gpu_case(vocab: int, dtype: torch.dtype):
    logits, rows, counts = _problem(vocab, "cuda")
    rows = rows * 8  # 72 rows
    return logits.repeat(8, 1).to(dtype), rows, counts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_penalties_and_min_p_match_the_cpu_sampler(dtype):
    import kernels.sampler as k

    logits, rows, counts = _gpu_case(129_280, dtype)
    width = max(r.num_logprobs for r in rows)
    got = k.sample(logits, k.sampling_tensors(rows, "cuda"), width, counts=(counts.output, counts.prompt))
    cpu_counts = TokenCounts(counts.vocab_size, "cpu", counts.num_slots)
    cpu_counts.output, cpu_counts.prompt = counts.output.cpu(), counts.prompt.cpu()
    ref = Sampler()(logits.float().cpu(), rows, cpu_counts)
    _check(ref, got, tol=2e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_rows_alone_give_their_batch_bits():
    import kernels.sampler as k

    logits, rows, counts = _gpu_case(129_280, torch.float32)
    tables = (counts.output, counts.prompt)
    batch = k.sample(logits, k.sampling_tensors(rows, "cuda"), 4, counts=tables)
    for i in range(9):
        alone = k.sample(logits[i : i + 1], k.sampling_tensors(rows[i : i + 1], "cuda"), 4, counts=tables)
        assert torch.equal(alone.token_ids, batch.token_ids[i : i + 1])
        assert torch.equal(alone.logprobs, batch.logprobs[i : i + 1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_kernel_in_a_cuda_graph_reads_the_token_counts_in_place():
    """A captured sample reads the counts where they live: tokens counted after the capture change the replay
    exactly as they change an eager call."""
    import kernels.sampler as k

    logits, rows, counts = _gpu_case(129_280, torch.float32)
    params = k.sampling_tensors(rows, "cuda")
    tables = (counts.output, counts.prompt)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        k.sample(logits, params, 4, counts=tables)  # compiles outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = k.sample(logits, params, 4, counts=tables)
    before = k.sample(logits, params, 4, counts=tables)
    top = before.token_ids[:4].clone()
    counts.record([0, 1, 2, 3], top)  # each penalised row's own choice, counted once more
    graph.replay()
    after = k.sample(logits, params, 4, counts=tables)
    assert torch.equal(captured.token_ids, after.token_ids) and torch.equal(captured.logprobs, after.logprobs)
    assert not torch.equal(after.logprobs[:4], before.logprobs[:4])
