"""Fixtures shared across the test tree."""

import os

# One torch/OpenMP thread count for the whole session and every process it starts (workers, the stack): 1
# unless OMP_NUM_THREADS is set (the robustness runs set 1, 2 and 4). Two threads beside another
# busy process spin and run 10–100× slower, and a subprocess at another thread count than the test process
# sums in another order (a remote worker's logprob then differs by an ulp), so every process gets this one.
SESSION_THREADS = int(os.environ.setdefault("OMP_NUM_THREADS", "1"))

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(SESSION_THREADS)  # in case a plugin imported torch before the variable was set

from tests.nats_server import running_nats_server  # noqa: E402 - after the thread-count setup above


@pytest.fixture(autouse=True)
def max_tokens_set(request, monkeypatch):
    """Every request a test queues sets its own max_tokens: unset means the rest of the context, which on a large
    max_model_len turns a quick test into a long one. A test that means it carries ``@pytest.mark.rest_of_context``.
    Offenders are recorded (a server thread's engine keeps serving) and fail the test at its teardown."""
    if request.node.get_closest_marker("rest_of_context") is not None:
        yield
        return
    from services.engine.engine import Engine

    add_request = Engine.add_request
    offenders: list[str] = []

    def guarded(self, request_id, prompt_token_ids, params, *args, **kwargs):
        if params.max_tokens is None:
            offenders.append(request_id)
        return add_request(self, request_id, prompt_token_ids, params, *args, **kwargs)

    monkeypatch.setattr(Engine, "add_request", guarded)
    yield
    if offenders:
        pytest.fail(f"requests {offenders[:5]} leave max_tokens unset (the rest of the context): set it")


@pytest.fixture(autouse=True)
def compile_cache_variables(monkeypatch):
    """The compile caches' variables as the session found them after each test: a test that runs `shinkai …` in
    this process sets them (services/cache_dirs.py), and that must not move later tests' caches."""
    from services.cache_dirs import CACHES

    for cache in CACHES:
        if cache.env is None:
            continue
        original = os.environ.get(cache.env)
        monkeypatch.setenv(cache.env, original or "")  # records the original: restored after the test
        if original is None:
            monkeypatch.delenv(cache.env)
    yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """The session's thread count for a module (1 by default: torch with 2 threads beside a busy process
    spins), restored after, so later tests and the worker subprocesses they compare with run at the same
    thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(SESSION_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def nats_url(tmp_path):
    """A fresh nats-server on a random loopback port for one test, stopped by PID afterwards."""
    with running_nats_server(tmp_path) as url:
        yield url
