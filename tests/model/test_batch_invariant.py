"""model/batch_invariant.py: inside the mode, a row's product is the same bits alone as in any batch, at
any place in it; the rerouted ops still compute what they stand for."""

import threading

import pytest
import torch
import torch.nn.functional as F

from model.batch_invariant import active, batch_invariant, summed_einsum


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("k, n", [(64, 32), (64, 4096), (512, 96), (7, 3)])
def test_linear_rows_are_equal_alone_and_in_any_batch(k, n):
    x, w = _randn(67, k, seed=1), _randn(n, k, seed=2)
    with batch_invariant():
        alone = [F.linear(x[i : i + 1], w) for i in range(x.shape[0])]
        for m in (2, 5, 16, 67):
            batch = F.linear(x[:m], w)
            for i in range(m):
                assert torch.equal(batch[i : i + 1], alone[i])
        # the same row at another place, beside other rows
        shuffled = F.linear(torch.cat((x[40:50], x[:3])), w)
        assert torch.equal(shuffled[10:13], torch.cat(alone[:3]))
        # the same through @ and through a Linear module
        assert torch.equal(x[:9] @ w.t(), torch.cat(alone[:9]))
        linear = torch.nn.Linear(k, n, bias=False)
        linear.weight.data.copy_(w)
        assert torch.equal(linear(x[3:6]), torch.cat(alone[3:6]))


def test_einsum_rows_are_equal_alone_and_in_any_batch():
    q, kv = _randn(12, 1, 4, 64, seed=3), _randn(12, 40, 64, seed=4)
    with batch_invariant():
        batch = torch.einsum("bshd,btd->bhst", q, kv)
        for i in range(12):
            assert torch.equal(torch.einsum("bshd,btd->bhst", q[i : i + 1], kv[i : i + 1]), batch[i : i + 1])
        bmm = torch.bmm(q[:, 0], kv.transpose(1, 2))
        assert torch.equal(torch.bmm(q[5:6, 0], kv[5:6].transpose(1, 2)), bmm[5:6])


@pytest.mark.parametrize(
    "equation, shapes",
    [
        ("bshd,btd->bhst", [(3, 2, 4, 8), (3, 5, 8)]),
        ("bhst,btd->bshd", [(3, 4, 2, 5), (3, 5, 8)]),
        ("bsgi,gri->bsgr", [(3, 2, 2, 16), (2, 6, 16)]),
        ("bshd,btd->bsht", [(2, 1, 3, 8), (2, 7, 8)]),
    ],
)
def test_summed_einsum_computes_the_einsum(equation, shapes):
    a, b = (_randn(*s, seed=i).double() for i, s in enumerate(shapes))
    assert torch.allclose(summed_einsum(equation, a, b), torch.einsum(equation, a, b), rtol=1e-12, atol=1e-12)


def test_products_compute_what_they_stand_for():
    """In float64 (where reduction order moves the result by ~1e-16) every rerouted op equals torch's own."""
    x, w, bias = _randn(5, 3, 16).double(), _randn(8, 16).double(), _randn(8).double()
    batched = _randn(5, 16, 4).double()
    with batch_invariant():
        got = [
            F.linear(x, w, bias),
            x @ w.t(),
            torch.matmul(x, batched[0]),
            torch.bmm(x, batched),
            torch.addmm(bias, x[0], w.t()),
            x[0, 0] @ w.t(),
            w @ x[0, 0],
        ]
    want = [
        F.linear(x, w, bias),
        x @ w.t(),
        torch.matmul(x, batched[0]),
        torch.bmm(x, batched),
        torch.addmm(bias, x[0], w.t()),
        x[0, 0] @ w.t(),
        w @ x[0, 0],
    ]
    for g, ref in zip(got, want):
        assert g.shape == ref.shape and torch.allclose(g, ref, rtol=1e-12, atol=1e-12)


def test_the_mode_is_scoped():
    assert not active()
    with batch_invariant():
        assert active()
        with batch_invariant(enabled=False):
            assert active()  # an inner no-op keeps the outer mode
    assert not active()
    with batch_invariant(enabled=False):
        assert not active()


def test_the_mode_is_per_thread_as_torch_keeps_it():
    """Another thread, running while one is inside the mode, sees neither the mode's maths nor ``active()``."""
    seen: list[bool] = []
    with batch_invariant():
        worker = threading.Thread(target=lambda: seen.append(active()))
        worker.start()
        worker.join()
        assert active()
    assert seen == [False]
    assert not active()


def test_einsum_with_three_operands_is_refused_not_silently_variant():
    a = _randn(2, 3)
    with batch_invariant(), pytest.raises(NotImplementedError, match="at most two operands"):
        torch.einsum("ij,jk,kl->il", a, a.t(), a)
