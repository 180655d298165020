"""The offline API: ``LLM(model="tiny").generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import Callable, Sequence

import torch

from services.engine.config import DEFAULT_MAX_MODEL_LEN, EngineConfig, default_max_model_len
from services.engine.engine import Engine
from services.engine.model_source import ModelSource, load_model
from services.engine.outputs import RequestOutput
from services.engine.precompile import preloaded
from services.engine.request_checks import check_priority, validate_request
from services.engine.sampling_params import SamplingParams
from services.engine.stats import EngineStats
from services.engine.step_worker import StepWorker
from services.engine.structured.grammars import GrammarCompiler
from services.engine.warmup import Progress, warm_up
from services.worker import startup
from services.worker.build import build_worker
from services.worker.kernel_model.kernel_set import KernelSet
from services.worker.worker import Runner

Prompt = str | Sequence[int]
log = logging.getLogger("shinkai.engine")


class LLM:
    def __init__(
        self,
        model: str = "tiny",
        runner: Runner | None = None,
        worker: StepWorker | None = None,
        source: ModelSource | None = None,
        kernels: Callable[[], contextlib.AbstractContextManager[KernelSet]] | None = None,
        progress: Progress | None = None,
        **engine_args: object,
    ) -> None:
        """``worker`` replaces the in-process worker (e.g. a `RemoteWorker`); ``runner`` only its runner;
        ``source`` is a model already loaded (benchmarks build many engines on one model), else ``model``
        is loaded. ``kernels``: the kernel backend's kernel set as a context (a module-level callable → a
        context manager yielding the ``KernelSet``; None: the compiled set) that this process (one engine, until
        ``close``) or each rank process runs inside: interpreted copies run the kernel backend on a CPU
        (kernels/interpret.py). ``progress(phase, done, total)``: the warm-up's (``warmup``;
        services/engine/warmup.py), beside the process's startup report (services/worker/startup.py)."""
        self.ranks = None  # the data-parallel group's driver (services/engine/parallel/ranks.py), with dp > 1
        self._kernel_context = contextlib.ExitStack()
        if int(engine_args.get("data_parallel_size", 1)) > 1:  # type: ignore[call-overload]
            if source is not None or runner is not None or worker is not None:
                raise ValueError(
                    "data_parallel_size > 1 starts its own rank processes, each loading the model: "
                    "pass model=, not source=, runner= or worker="
                )
            self._start_ranks(model, engine_args, kernels)
            return
        kernel_set = None if kernels is None else self._kernel_context.enter_context(kernels())
        builds_model = source is None and runner is None and worker is None
        if builds_model:  # the device and, on CUDA, the fast path's defaults (services/engine/device.py)
            from services.engine.device import device_engine_args

            engine_args = device_engine_args(engine_args)
        self.config = EngineConfig(**engine_args)  # type: ignore[arg-type]
        self.pool_plan = None  # the PoolPlan when the pools were sized from gpu_memory_utilization
        on_cuda = builds_model and str(self.config.device).startswith("cuda")
        # The device's memory planned before any byte is loaded (services/engine/memory_plan.py).
        memory = plan_memory(model, self.config) if on_cuda and self.config.kernel_backend is not None else None
        # An earlier start's variants compile beside the load, done before any launch (services/engine/precompile.py).
        with preloaded(self.config, model, source, enabled=self.config.warmup and worker is None) as preload:
            if source is None:
                # With a remote worker the weights are its own: only config and tokenizer load here (no device).
                with reported_oom(memory, self.config, "loading the model"), startup.phase("loading"):
                    source = load_model(
                        model,
                        seed=self.config.model_seed,
                        device=self.config.device or "cpu",
                        load_format=self.config.load_format,
                        precision=self.config.kernel_backend,
                        weights=worker is None,
                        expert_format=self.config.expert_format,
                        engram_on_host=self.config.engram_on_host,
                    )
                if on_cuda:
                    from services.engine.memory_plan import log_device_bytes

                    log_device_bytes(source.model)
        try:  # the precompile's processes end with the start, whatever ends it
            self.source = source
            model_max = source.config.max_position_embeddings
            if self.config.max_model_len > model_max:
                raise ValueError(
                    f"max_model_len {self.config.max_model_len} is longer than the model's {model_max} positions"
                )
            fit_len = "max_model_len" not in engine_args  # the default: the model's, within what the pools hold
            if fit_len:
                self.config = self.config.replace(max_model_len=model_max)
            sized = builds_model and str(self.config.device).startswith("cuda") and self.config.num_blocks is None
            if sized:
                from services.engine.pool_sizing import size_pools

                with (
                    reported_oom(memory, self.config, "profiling a step to size the pools"),
                    startup.phase("profiling"),
                ):
                    self.config, self.pool_plan = size_pools(
                        self.source,
                        self.config,
                        lambda probe: LLM(
                            source=self.source,
                            **{**{f: getattr(probe, f) for f in probe.__dataclass_fields__}, "warmup": False},
                        ),
                        fit_max_model_len=fit_len,
                    )
            if fit_len:
                self.config = self.config.replace(max_model_len=default_max_model_len(self.config, model_max))
                log.info(
                    "max_model_len %d: the model supports %d positions; %s",
                    self.config.max_model_len,
                    model_max,
                    f"the pools hold {(self.config.num_blocks - 1) * self.config.block_size} tokens for one request"
                    if self.config.num_blocks is not None
                    else f"pools sized from it on {self.config.device or 'cpu'} "
                    f"(at most {DEFAULT_MAX_MODEL_LEN} there)",
                )
            cfg = self.source.config
            self.tokenizer = self.source.tokenizer
            kv_ratios = sorted({cfg.ratio(layer) for layer in cfg.kv_source_layer_ids}, reverse=True)
            if (
                worker is not None
                and self.config.num_speculative_tokens
                and getattr(worker, "speculator", None) is None
            ):
                raise ValueError(
                    "num_speculative_tokens needs the in-process worker with a speculator: a remote "
                    "worker's protocol does not carry drafts yet"
                )
            if worker is None:
                worker = build_worker(self.source.model, self.config.worker_config(), runner=runner, kernels=kernel_set)
            self.engine = Engine(
                worker,
                self.config,
                vocab_size=cfg.vocab_size,
                eos_token_id=cfg.eos_token_id,
                compress_ratios=kv_ratios or [1],
                window_size=cfg.sliding_window,
                grammars=GrammarCompiler(self.tokenizer, cfg.vocab_size, cfg.eos_token_id),
                image_token_id=cfg.vision.image_token_id if cfg.vision is not None else None,
                model=model,
            )
            self._ids = itertools.count()
            self._chat = None  # the chat renderer (services/tokenizer/chat.py), made on the first chat call
            if self.config.warmup:
                with startup.phase("compiling") as step:

                    def report(phase: str, done: int, total: int) -> None:
                        step.count(done, total)
                        if progress is not None:
                            progress(phase, done, total)

                    warm_up(self.engine, report, compiled_ahead=None if preload is None else preload.wait_sampler)
        finally:
            if preload is not None:
                preload.close()

    def _start_ranks(
        self,
        model: str,
        engine_args: dict[str, object],
        kernels: Callable[[], contextlib.AbstractContextManager[KernelSet]] | None,
    ) -> None:
        """One process per rank, each with its engine and its share of the experts; this process keeps only
        the config and tokenizer. A rank's defaults are one process's on its device
        (`rank_engine_args`, docs/parallelism.md)."""
        from functools import partial

        from services.engine.device import resolve_device
        from services.engine.parallel.rank import RankSpec, rank_engine_args
        from services.engine.parallel.ranks import Ranks

        device = resolve_device(engine_args.get("device"))  # type: ignore[arg-type]
        if device.startswith("cuda") and engine_args.get("device") is None:
            device = "cuda"
        args = rank_engine_args(engine_args, device)
        if device.startswith("cuda:"):
            raise ValueError(f"with data_parallel_size > 1 rank r runs on cuda:r; pass device='cuda', not {device!r}")
        self.config = EngineConfig(**{**args, "device": device})  # type: ignore[arg-type]
        self.pool_plan = None
        self.source = load_model(model, seed=self.config.model_seed, load_format=self.config.load_format, weights=False)
        self.tokenizer = self.source.tokenizer
        self._ids = itertools.count()
        self._chat = None
        load = partial(
            load_model,
            model,
            self.config.model_seed,
            load_format=self.config.load_format,
            precision=self.config.kernel_backend,  # on CUDA the kernel form, as one process loads it
            expert_format=self.config.expert_format,
        )
        self.ranks = Ranks(RankSpec(self.config, load, "", device, kernels=kernels))

    def close(self) -> None:
        """Stops the rank processes of a data-parallel LLM, and leaves the ``kernels`` context of one engine."""
        if self.ranks is not None:
            self.ranks.close()
        self._kernel_context.close()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt, add_special_tokens=True).ids
            bos = self.source.config.bos_token_id
            return ids if ids[:1] == [bos] else [bos, *ids]
        return [int(t) for t in prompt]

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        priority: int | Sequence[int] = 0,
    ) -> list[RequestOutput]:
        """``priority``: one for every prompt or one each; lower is served first (vLLM's convention)."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"{len(params_list)} sampling params for {len(prompts)} prompts")
        priorities = list(priority) if isinstance(priority, Sequence) else [priority] * len(prompts)
        if len(priorities) != len(prompts):
            raise ValueError(f"{len(priorities)} priorities for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        vision = self.source.config.vision
        if vision is not None and any(vision.image_token_id in ids for ids in encoded):
            raise ValueError(
                f"a prompt holds the image placeholder id {vision.image_token_id} without an image; "
                "send images as image_url parts through LLM.chat"
            )
        return self._run(encoded, params_list, [None] * len(encoded), use_tqdm, priorities)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        **chat_options: object,
    ) -> list[RequestOutput]:
        """OpenAI-style chat ``messages`` (one conversation, or a list of them) rendered by deepseek-recipe,
        ``image_url`` parts included (data URLs, or http(s) fetched with a size limit and timeout); the
        images run through the model's vision tower here. ``chat_options`` are the body's other conversation
        keys (``thinking``, ``reasoning_effort``, ``tools``, ``tool_choice``)."""
        from services.engine.images.prompt import expand_images
        from services.tokenizer.chat import IMAGE_PLACEHOLDER, ChatRenderer

        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = sampling_params if sampling_params is not None else SamplingParams()
        params_list = list(params) if isinstance(params, Sequence) else [params] * len(conversations)
        if len(params_list) != len(conversations):
            raise ValueError(f"{len(params_list)} sampling params for {len(conversations)} conversations")
        if self._chat is None:
            from model.deepseek_v41.tokenizer import V41_VOCAB_SIZE, v41_tokenizer_path

            if self.tokenizer.get_vocab_size() != V41_VOCAB_SIZE:
                raise ValueError("LLM.chat renders with DeepSeek's V4.1 vocabulary; this model has its own")
            self._chat = ChatRenderer(v41_tokenizer_path())
        placeholder = self.tokenizer.token_to_id(IMAGE_PLACEHOLDER)
        encoded, images = [], []
        for conversation in conversations:
            rendered = self._chat.render({"messages": list(conversation), **chat_options})
            ids, rows = expand_images(rendered.token_ids, rendered.image_urls, placeholder, self.source.model)  # type: ignore[arg-type]
            encoded.append(ids)
            images.append(rows)
        return self._run(encoded, params_list, images, use_tqdm)

    def _run(
        self,
        encoded: list[list[int]],
        params_list: list[SamplingParams],
        images: list[torch.Tensor | None],
        use_tqdm: bool,
        priorities: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Queues every prompt (``images``: each one's placeholder embeddings or None; ``priorities``: each
        one's, 0 when None) and steps until all end."""
        priorities = priorities if priorities is not None else [0] * len(encoded)
        for ids, p, priority in zip(encoded, params_list, priorities):  # all checked before anything is queued
            if self.ranks is None:
                self.engine.validate(ids, p)  # with what this engine's worker can serve
            else:
                validate_request(ids, p, self.source.config.vocab_size, self.config)
            check_priority(priority)
        request_ids = [str(next(self._ids)) for _ in encoded]  # unique across ranks: one counter here
        if self.ranks is not None:
            if any(priorities):
                raise ValueError("priority does not reach data-parallel ranks yet; run at data_parallel_size 1")
            if any(p.constraint is not None for p in params_list):
                raise ValueError(
                    "structured output does not reach data-parallel ranks yet; run at data_parallel_size 1"
                )
            if any(rows is not None for rows in images):
                raise ValueError(
                    "images do not reach data-parallel ranks yet; run LLM.chat with images at data_parallel_size 1"
                )
            outputs = self.ranks.generate(list(zip(request_ids, encoded, params_list)))
            for out in outputs:
                out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            return outputs
        for request_id, ids, p, rows, priority in zip(request_ids, encoded, params_list, images, priorities):
            self.engine.add_request(request_id, ids, p, ready=rows is None, priority=priority)
            if rows is not None:
                self.engine.provide_images(request_id, rows)
        finished: dict[tuple[str, int], RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(request_ids), desc="generate", unit="req")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished and (out.request_id, out.index) not in finished:
                    out.text = self.tokenizer.decode(out.token_ids, skip_special_tokens=True)
                    finished[(out.request_id, out.index)] = out
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        # A prompt with n > 1 gives its n choices in a row, by index.
        return [finished[(r, i)] for r, p in zip(request_ids, params_list) for i in range(p.n)]

    def stats(self) -> EngineStats:
        if self.ranks is not None:
            raise ValueError("a data-parallel LLM's pools live in its rank processes; their stats are not gathered yet")
        return self.engine.stats()


def plan_memory(model: str, config: EngineConfig):
    """The memory estimate of ``model`` (a preset or checkpoint directory) under ``config`` on its CUDA device,
    logged; raises ``memory_plan.NotEnoughMemory`` when it cannot fit (services/engine/memory_plan.py)."""
    import torch

    from services.engine import memory_plan

    cfg = load_model(model, seed=config.model_seed, load_format=config.load_format, weights=False).config
    total = torch.cuda.mem_get_info(torch.device(config.device or "cuda"))[1]
    plan = memory_plan.estimate(cfg, config)
    memory_plan.log.info("memory plan for %s: %s; device total %.1f GiB", model, plan.describe(), total / 2**30)
    memory_plan.check(plan, config, total, model)
    return plan


@contextlib.contextmanager
def reported_oom(plan, config: EngineConfig, stage: str):
    """A CUDA out-of-memory inside the block raised as ``memory_plan.NotEnoughMemory`` (the estimate and what helps)."""
    import torch

    try:
        yield
    except torch.OutOfMemoryError as e:
        from services.engine.memory_plan import out_of_memory

        raise out_of_memory(plan, config, stage, e) from None
