"""Which device an engine's model runs on, and the engine defaults that follow from it.

``--device`` takes ``cpu``, ``cuda`` or ``cuda:N``; unset, it is ``cuda`` when CUDA is available, else
``cpu``. On CUDA the defaults are the fast path: the FP8 kernel backend with the routed experts kept
MXFP4, CUDA graphs for decode and async scheduling, each with an off switch (``kernel_backend=None``,
``expert_format="fp8"``, ``enforce_eager=True``, ``async_scheduling=False``). A default applies only where
the caller did not set that field.

``--kernels interpreted`` runs the kernel backend on the CPU with its Triton kernels under Triton's interpreter
(services/worker/kernel_model/interpreted_kernels.py): the GPU's code path, the expert-parallel exchange of
``--dp N`` included, on a machine without one, for debugging and CI (seconds a step for a few-layer model).
"""

from __future__ import annotations

import re

CUDA_DEFAULTS = {"kernel_backend": "fp8", "async_scheduling": True, "expert_format": "fp4"}
"""EngineConfig fields set on CUDA unless given (``cuda_graphs`` follows ``enforce_eager`` and the backend)."""

_DEVICE = re.compile(r"^(cpu|cuda)(:(\d+))?$")


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_device(device: str | None) -> str:
    """``device`` checked (a clear error naming it otherwise), or the default when None."""
    if device is None:
        return default_device()
    match = _DEVICE.match(device)
    if match is None or (match.group(1) == "cpu" and match.group(2)):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if match.group(1) == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
        index = int(match.group(3) or 0)
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r} asked for, but this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    return device


def device_engine_args(engine_args: dict[str, object]) -> dict[str, object]:
    """``engine_args`` (EngineConfig fields) with ``device`` resolved and, on CUDA, the fast path's defaults
    filled in where not given."""
    out = dict(engine_args)
    out["device"] = resolve_device(out.get("device"))  # type: ignore[arg-type]
    if str(out["device"]).startswith("cuda"):
        speculative = bool(out.get("num_speculative_tokens"))
        for key, value in CUDA_DEFAULTS.items():
            # Speculative decoding's async path (the seqlen fix-up) is CPU-tested only so far: not its default.
            out.setdefault(key, False if speculative and key == "async_scheduling" else value)
        if "cuda_graphs" not in out:  # nor are graphs with drafts (CPU-tested static verify steps; GPU-untested)
            out["cuda_graphs"] = (
                out["kernel_backend"] is not None and not out.get("enforce_eager", False) and not speculative
            )
        out.setdefault("warmup", out["kernel_backend"] is not None)  # where Triton compiles: before ready
    return out


def add_device_arguments(parser) -> None:
    """The device flags shared by generate, serve, up, the engine and the worker processes."""
    parser.add_argument(
        "--device", default=None, help="cpu, cuda or cuda:N (default: cuda when CUDA is available, else cpu)"
    )
    parser.add_argument(
        "--enforce-eager", action="store_true", help="on CUDA, run decode eagerly instead of replaying CUDA graphs"
    )
    parser.add_argument(
        "--no-async-scheduling",
        dest="async_scheduling",
        action="store_false",
        default=None,
        help="on CUDA, plan each step after the previous one finished (async is the CUDA default)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of GPU memory for model, activations and pools (default 0.9)",
    )
    parser.add_argument(
        "--expert-format",
        choices=("fp4", "fp8"),
        default=None,
        help="routed experts on the GPU: fp4 = MXFP4 as released (default), fp8 = converted at load",
    )
    parser.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default=None,
        help="dummy: random weights drawn on the device for the model's config, no checkpoint read",
    )


DEVICE_FIELDS = (
    "device",
    "enforce_eager",
    "async_scheduling",
    "gpu_memory_utilization",
    "expert_format",
    "load_format",
)
"""EngineConfig fields the device flags set (argparse dests of the same names)."""


def device_args(args) -> dict[str, object]:
    """The EngineConfig fields the parsed device flags give (flags left unset are left out)."""
    out = {name: getattr(args, name, None) for name in DEVICE_FIELDS}
    if not out["enforce_eager"]:
        out["enforce_eager"] = None  # store_true's False means "not given"
    return {k: v for k, v in out.items() if v is not None}


def device_argv(values: dict[str, object]) -> list[str]:
    """``device_args``' inverse: the flags that reproduce ``values`` on another process's command line."""
    argv: list[str] = []
    for name, value in values.items():
        if value is None:
            continue
        if name == "enforce_eager":
            argv += ["--enforce-eager"] if value else []
        elif name == "async_scheduling":
            argv += [] if value else ["--no-async-scheduling"]
        else:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


def add_kernel_arguments(parser) -> None:
    """``--kernels``, on the commands that honour it (generate)."""
    parser.add_argument(
        "--kernels",
        choices=("interpreted",),
        default=None,
        help="interpreted: the kernel backend on the CPU, its MoE, norm and attention kernels run by Triton's "
        "interpreter (debugging and CI without a GPU; slow: a few-layer checkpoint, `shinkai model init --preset "
        "tiny --num-layers 3`, takes seconds a step). Default: compiled kernels on CUDA, the torch model on the CPU",
    )


def kernel_args(kernels: str | None, engine_args: dict[str, object]) -> dict[str, object]:
    """The ``LLM`` arguments ``--kernels`` gives beside ``engine_args`` (the other EngineConfig fields, checked
    against it): for "interpreted", the CPU device, the FP8 kernel backend (unless given) and the interpreted
    kernel set as ``kernels`` (a module-level callable, so it reaches spawned rank processes), its torch parts in
    the CPU batch-invariant maths with ``batch_invariant``. None: nothing."""
    if kernels is None:
        return {}
    if kernels != "interpreted":
        raise ValueError(f"--kernels takes 'interpreted', got {kernels!r}")
    device = engine_args.get("device")
    if device is not None and device != "cpu":
        raise ValueError(
            f"--kernels interpreted runs Triton's interpreter on the CPU, but --device is {device!r}: on a GPU "
            "the kernels run compiled (leave --kernels out), or pass --device cpu"
        )
    if engine_args.get("kernel_backend", "fp8") is None:
        raise ValueError("--kernels interpreted runs the kernel backend; it cannot go with kernel_backend None")
    from functools import partial

    from services.worker.kernel_model.interpreted_kernels import step_kernels

    return {
        "device": "cpu",
        "kernel_backend": engine_args.get("kernel_backend", "fp8"),
        "kernels": partial(step_kernels, batch_invariant=bool(engine_args.get("batch_invariant"))),
    }
