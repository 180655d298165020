"""The compile manifest's variants (services/worker/compile_manifest.py) compiled beside the weight load: what an
earlier start of the same engine compiled, ready before the first launch of the pool profile, the graph captures
and the warm-up.

The manifest needs only what picks the variants (the model's config, the engine's ``VARIANT_FIELDS``, the device),
all known before a byte of the weights is read, so ``LLM`` starts the precompile first and loads the weights while
it runs (``preloaded``):

- **start**, on the calling thread: the manifest's key, the recording of this start's compiles into it (the load's
  own included), and each entry's kernel found (imports, Triton's per-device tables: never concurrently with the
  loading thread's own). On CUDA the entries, and the sampler kernel's variants (listed without a compile: its
  rows' parameters pick them, so they are known before any step), go to a pool of spawned processes
  (services/worker/compile_pool.py) that compile them into Triton's file cache with no GIL between them. Then a
  thread of its own waits for the manifest's and preloads them on a pool of one thread per CPU (file-cache reads
  where the processes compiled them), reported as the ``compiling`` phase *beside* ``loading``
  (services/worker/startup.py, "A phase beside the others": the probes show ``loading 12/40 9 s; beside:
  compiling 30/130 9 s``, and its compiles are counted under ``compiling``).
- **wait_sampler**, at the warm-up: waits for the sampler's variants, then lets the processes end (``close``: also at
  the end of the start, whatever ends it).
- **join**, before anything launches a step (the pool profile): waits for it; while the load is done and the compiles
  are not, the probes report ``compiling`` with its count.
- **never fails the start**: an entry whose kernel is gone, whose parameters changed or whose compile fails is
  skipped and counted (``num_stale``), and anything else that goes wrong in the precompile is logged and leaves
  the variants to compile when launched. Where the load fails, the compiles not yet begun are cancelled.

The weights' reads and copies and the compiler's ptxas subprocesses release the GIL; Triton's own passes run in
the pool's threads and the load's Python in the caller's, so the two share the interpreter for those parts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator

from services.engine.config import EngineConfig
from services.engine.model_source import ModelSource
from services.worker import startup
from services.worker.compile_manifest import CompileManifest, Precompiled, Resolved
from services.worker.compile_pool import Ahead, CompilePool, current_target, entry_of, listed, num_processes_for

log = logging.getLogger("shinkai.engine")

PHASE = "compiling"

VARIANT_FIELDS = (
    "kernel_backend",
    "expert_format",
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "scheduling",
    "num_speculative_tokens",
    "spec_varlen",
    "spec_sampling",
    "cuda_graphs",
    "async_scheduling",
    "batch_invariant",
    "enable_prefix_caching",
)
"""The engine fields that pick kernel variants, in the compile manifest's key with the model's config. Left out:
pool sizes and ``max_model_len`` (sized from the device's free memory, they vary between starts; the variants of a
longer context than the last start's compile on first use or in the warm-up, and are recorded then)."""


def compile_manifest(config: EngineConfig, model_cfg: object) -> CompileManifest:
    """This engine's compile manifest under the cache root: keyed by the model's config (a dataclass), the
    ``VARIANT_FIELDS``, the device and the versions (services/worker/manifest_key.py), its key file written."""
    picks = {"model": dataclasses.asdict(model_cfg), **{f: getattr(config, f) for f in VARIANT_FIELDS}}  # type: ignore[call-overload]
    return CompileManifest.described_under_root(picks, config.device or "cpu")


def model_config(model: str):
    """``model``'s config (a preset name or a checkpoint directory) without its weights or tokenizer."""
    from pathlib import Path

    from model.deepseek_v41.config import load_config
    from model.deepseek_v41.presets import PRESETS, preset

    return preset(model) if model in PRESETS else load_config(Path(model))


class Preload:
    """One start's precompile on a thread of its own (module docstring): ``start()``, then ``join()`` or
    ``cancel()``."""

    def __init__(
        self, manifest: CompileManifest, device: str, workers: int | None = None, sampler_vocab: int | None = None
    ) -> None:
        self.manifest = manifest  # whose entries it compiles, and where this start's compiles are recorded
        self.device = device  # the engine's device: the compiling threads' current one
        self.workers = workers  # compiling threads; None: one per CPU the process may use
        self.sampler_vocab = sampler_vocab  # the sampler kernel's vocabulary, where its variants compile ahead too
        self.result: Precompiled | None = None  # once joined, where it ran to its end
        self.pool: CompilePool | None = None  # on CUDA: the processes compiling ahead (services/worker/compile_pool.py)
        self.manifest_ahead = Ahead()  # the manifest's entries in the pool, awaited before the threads preload them
        self.sampler_ahead = Ahead()  # the sampler's variants in the pool, awaited by the warm-up (``wait_sampler``)
        self.started = threading.Event()  # set once its phase is entered (reported beside), or once it stopped short
        self._stop = threading.Event()
        self._index: int | None = None  # the CUDA device's index (``start``); None off CUDA
        self._thread: threading.Thread | None = None

    def start(self) -> Preload:
        try:
            if self.device.startswith("cuda"):  # "cuda" alone: the caller's current device, as the engine's own
                import torch

                index = torch.device(self.device).index
                self._index = torch.cuda.current_device() if index is None else index
            self.manifest.record()
            with self._on_device():
                resolved = self.manifest.resolve()
                try:
                    self._compile_ahead(resolved)
                except Exception as e:  # the threads compile the manifest alone; the sampler's at the warm-up
                    log.warning("precompile: no processes compiling ahead (%s)", e)
                    self.close()
                    self.manifest_ahead = self.sampler_ahead = Ahead()
        except Exception as e:  # never fails the start: the variants compile when launched
            log.warning("precompile: not started (%s)", e)
            return self
        self._thread = threading.Thread(target=self._run, args=(resolved,), name="precompile", daemon=True)
        self._thread.start()
        return self

    def _run(self, resolved) -> None:
        try:
            self._set_device()
            with startup.beside(PHASE) as step:
                self.started.set()
                self.manifest_ahead.wait(step.count, self._stop)  # then the threads read them from Triton's cache
                self.result = self.manifest.precompile(
                    self.workers, step.count, resolved, thread_setup=self._thread_setup(step), stop=self._stop
                )
        except Exception as e:  # never fails the start: the variants compile when launched
            log.warning("precompile: stopped (%s)", e)
        finally:
            self.started.set()

    def _compile_ahead(self, resolved: Resolved) -> None:
        """On CUDA, the manifest's entries and then the sampler's variants (``sampler_vocab``, listed without a
        compile) go to a pool of processes (services/worker/compile_pool.py), started here."""
        if self._index is None:
            return
        manifest_entries = [entry_of(fn.fn.__module__, fn.fn.__qualname__, data) for fn, data in resolved.kernels]
        known = {entry["specialization_data"] for entry in manifest_entries}
        sampler_entries: list[dict[str, str]] = []
        if self.sampler_vocab is not None:
            from services.worker.sampling.kernel_sampler import KernelSampler

            with listed() as sampler_entries:
                KernelSampler().compile_variants(self.sampler_vocab, self.device, workers=1)
            sampler_entries = [e for e in sampler_entries if e["specialization_data"] not in known]
        num_entries = len(manifest_entries) + len(sampler_entries)
        if num_entries == 0:
            return
        self.pool = CompilePool(current_target(), num_processes_for(num_entries))
        self.manifest_ahead = self.pool.submit(manifest_entries)
        self.sampler_ahead = self.pool.submit(sampler_entries)
        log.info(
            "precompile: %d variants of the manifest and %d of the sampler compiling in %d processes",
            len(manifest_entries),
            len(sampler_entries),
            self.pool.num_processes,
        )

    def wait_sampler(self) -> None:
        """Waits for the sampler's variants compiled ahead (so the warm-up reads them from Triton's cache rather than
        compile them again), then lets the pool's processes end."""
        self.sampler_ahead.wait(stop=self._stop)
        if self.sampler_ahead.futures:
            log.info(
                "precompile: the sampler's %d variants compiled ahead (%.1f s of compiles, %d failed)",
                len(self.sampler_ahead.futures),
                self.sampler_ahead.seconds,
                self.sampler_ahead.num_failed,
            )
        self.close()

    def close(self) -> None:
        """The pool's compiles not begun are cancelled; its processes end after those under way."""
        if self.pool is not None:
            self.pool.close()

    def _thread_setup(self, step: startup.PhaseStep):
        def setup() -> None:
            step.mark_thread()  # their compiles count under this phase (services/worker/compile_stats.py)
            self._set_device()

        return setup

    def _set_device(self) -> None:
        """The engine's CUDA device as the calling thread's current one (Triton compiles for the current device)."""
        if self._index is not None:
            import torch

            torch.cuda.set_device(self._index)

    def _on_device(self) -> contextlib.AbstractContextManager:
        """``_set_device`` for the block only (the caller's thread)."""
        if self._index is not None:
            import torch

            return torch.cuda.device(self._index)
        return contextlib.nullcontext()

    def join(self) -> Precompiled | None:
        """Waits for the compiles to end; logs and returns what they did (None: it never ran to its end)."""
        if self._thread is not None:
            self._thread.join()
        done = self.result
        if done is not None:
            log.info(
                "precompiled %d kernel variants of %d recorded in %.1f s (%d stale) from %s",
                done.num_preloaded,
                done.num_entries,
                done.seconds,
                done.num_stale,
                self.manifest.directory,
            )
        return done

    def cancel(self) -> None:
        """No further compile starts; the thread ends after those under way (it is not waited for)."""
        self._stop.set()
        self.close()


@contextlib.contextmanager
def preloaded(
    config: EngineConfig, model: str, source: ModelSource | None = None, enabled: bool = True
) -> Iterator[Preload | None]:
    """The precompile of ``config``'s engine of ``model`` (``source``: the model, where loaded already) running while
    the block runs (the weight load), and joined when it ends; cancelled where the block raises. Yields None where
    not ``enabled`` or where it could not start (logged; the start goes on)."""
    if not enabled:
        yield None
        return
    try:
        cfg = source.config if source is not None else model_config(model)
        # The sampler kernel's variants ahead too, where its kernel samples (services/worker/worker.py; not with
        # drafts: the speculator samples in torch).
        sampler_vocab = (
            cfg.vocab_size if config.kernel_backend is not None and not config.num_speculative_tokens else None
        )
        preload: Preload | None = Preload(
            compile_manifest(config, cfg), config.device or "cpu", sampler_vocab=sampler_vocab
        ).start()
    except Exception as e:  # an unreadable config fails the load itself, with its own message
        log.warning("precompile: not started (%s)", e)
        preload = None
    try:
        yield preload
    except BaseException:
        if preload is not None:
            preload.cancel()
        raise
    if preload is not None:
        preload.join()
