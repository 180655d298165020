"""services/engine/precompile.py through ``LLM`` on the CPU: the compile manifest's precompile begins before the
weights load and runs beside it (the load waits until it has begun, and reads the readiness state then), it is done
before anything launches a step (the warm-up), and nothing in it fails a start. The manifest's key follows the fields
that pick variants and no other. Real compiles beside a load: tests/services/worker/test_compile_manifest.py."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import pytest

from services.engine import llm as llm_module
from services.engine.config import EngineConfig
from services.engine.precompile import Preload, compile_manifest
from services.worker import startup
from services.worker.compile_manifest import CompileManifest, recording, stop_recording
from services.worker.startup import StartupProgress
from tests.model.deepseek_v41.oracle_configs import ORACLE

TIMEOUT_S = 30.0
ENGINE = dict(model="tiny", device="cpu", warmup=True, block_size=16, max_num_batched_tokens=64, max_num_seqs=4)


@pytest.fixture
def start(monkeypatch, tmp_path):
    """A private cache root and startup progress; the warm-up replaced by a note of when it ran."""
    monkeypatch.setenv("SHINKAI_CACHE_DIR", str(tmp_path))
    progress = StartupProgress()
    monkeypatch.setattr(startup, "PROGRESS", progress)
    events: list[str] = []
    monkeypatch.setattr(llm_module, "warm_up", lambda engine, report, **_: events.append("warm-up"))
    yield progress, events
    stop_recording()


def test_the_precompile_runs_beside_the_load_and_ends_before_the_warm_up(start, monkeypatch):
    progress, events = start
    looked = threading.Event()  # the load has read the state: the precompile may go on
    precompile = CompileManifest.precompile

    def precompile_after_the_load_looked(self, *args, **kwargs):
        events.append("precompile begins")
        if not looked.wait(TIMEOUT_S):
            raise TimeoutError("the load never began beside the precompile")
        # Outlasts the load: what comes after it (the pools, the warm-up) must wait for the join.
        if not wait_for(lambda: "loaded" in events):
            raise TimeoutError("the load did not end")
        time.sleep(0.5)
        done = precompile(self, *args, **kwargs)
        events.append("precompile ends")
        return done

    load, during = llm_module.load_model, []

    def load_once_the_precompile_began(*args, **kwargs):
        if not wait_for(lambda: "precompile begins" in events):
            raise TimeoutError("the precompile did not begin before the load")
        during.append(progress.state())
        looked.set()
        source = load(*args, **kwargs)
        events.append("loaded")
        return source

    monkeypatch.setattr(CompileManifest, "precompile", precompile_after_the_load_looked)
    monkeypatch.setattr(llm_module, "load_model", load_once_the_precompile_began)
    llm = llm_module.LLM(**ENGINE)
    assert events == ["precompile begins", "loaded", "precompile ends", "warm-up"]
    (state,) = during
    assert state.phase == "loading" and [b.phase for b in state.beside] == ["compiling"]
    assert "loading" in progress.durations() and "compiling" in progress.durations()
    # This start's compiles are recorded into the manifest of the model it loaded.
    assert recording().directory == compile_manifest(llm.config, llm.source.config).directory


def test_a_failing_precompile_does_not_fail_the_start(start, monkeypatch, caplog):
    _, events = start

    def broken(self, *args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(CompileManifest, "precompile", broken)
    llm_module.LLM(**ENGINE)
    assert events == ["warm-up"]
    assert "precompile: stopped (no compiler)" in caplog.text


def test_a_failing_load_cancels_the_precompile(start, monkeypatch):
    cancelled = []
    monkeypatch.setattr(Preload, "cancel", lambda self: cancelled.append(self.manifest))

    def failing_load(*args, **kwargs):
        raise OSError("disk gone")

    load = llm_module.load_model
    monkeypatch.setattr(llm_module, "load_model", failing_load)
    with pytest.raises(OSError, match="disk gone"):
        llm_module.LLM(**ENGINE)
    assert len(cancelled) == 1
    monkeypatch.setattr(llm_module, "load_model", load)
    # A model that is none: the load's own message, not the precompile's.
    with pytest.raises(ValueError, match="neither a checkpoint directory nor a preset"):
        llm_module.LLM(**{**ENGINE, "model": "/no/such/model"}, load_format="auto")


def test_the_compile_manifest_is_keyed_by_what_picks_the_variants(monkeypatch, tmp_path):
    monkeypatch.setenv("SHINKAI_CACHE_DIR", str(tmp_path))
    config = EngineConfig(device="cpu", block_size=4, max_model_len=32, max_num_seqs=4, max_num_batched_tokens=8)
    manifest = compile_manifest(config, ORACLE)
    assert manifest.directory.parent == tmp_path / "variants"
    # Pool sizes and max_model_len vary between starts on one device (sized from its free memory): one manifest.
    assert compile_manifest(config.replace(num_blocks=99, max_model_len=64), ORACLE).directory == manifest.directory
    for other in (config.replace(max_num_seqs=2), config.replace(kernel_backend="fp8")):
        assert compile_manifest(other, ORACLE).directory != manifest.directory
    assert compile_manifest(config, dataclasses.replace(ORACLE, hidden_size=128)).directory != manifest.directory


def wait_for(condition, timeout_s: float = TIMEOUT_S) -> bool:
    done = threading.Event()
    deadline = threading.Timer(timeout_s, done.set)
    deadline.start()
    try:
        while not condition():
            if done.wait(0.01):
                return condition()
        return True
    finally:
        deadline.cancel()


def test_the_compiling_threads_run_on_the_engine_device(monkeypatch, tmp_path):
    """Triton compiles for the thread's current CUDA device: the precompile's thread takes the engine's (``cuda:N``'s
    N, or for ``cuda`` the starting thread's current one), without changing the starting thread's."""
    import torch

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch.cuda, "set_device", lambda i: calls.append((threading.current_thread().name, i)))
    monkeypatch.setattr(torch.cuda, "device", lambda i: calls.append(("scoped", i)) or contextlib.nullcontext())
    for device, index in (("cuda", 3), ("cuda:1", 1)):
        calls.clear()
        preload = Preload(CompileManifest(tmp_path / "none"), device).start()
        assert preload.join() is not None
        assert calls == [("scoped", index), ("precompile", index)]
    stop_recording()
