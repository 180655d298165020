"""The worker as its own process: ``worker.v1.Worker`` over gRPC around the in-process `Worker`.

``python -m services.entrypoints.worker --model tiny --grpc-addr 127.0.0.1:0`` builds (or loads) the model itself from
the same ``--model`` and ``--model-seed`` as the engine, owns the runner's pools, and prints one JSON ready
line. ``SetImages`` takes a request's image embeddings (float32 or bfloat16 bytes with their shape) before
the request is scheduled, as the in-process ``Worker.set_images`` does. ``GetModelInfo`` answers hashes of the config
and of every weight tensor; the engine compares them with its own at connect time, so an engine never drives a
different model.

The codec turns a scheduler ``StepPlan`` into the proto (every array as raw int32 bytes with dtype and
shape) and back into `PlanView`, a plain object with the StepPlan attributes the runners read.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import grpc
import numpy as np
import prometheus_client as prom
import torch

from kernels.sampler_output import SamplerOutput
from observability import metrics as names
from observability import tracing
from services.proto.worker.v1 import worker_pb2 as pb
from services.proto.worker.v1 import worker_pb2_grpc
from services.worker.sampling.sampler import SamplingRow
from services.worker.worker_output import WorkerOutput

SERVICE = "worker.v1.Worker"
MAX_MESSAGE_BYTES = 256 * 2**20
"""Both ends' gRPC message limit (sent and received). The largest messages: a step's logprob arrays, and
``SetImages``: at most 8 images × 1,024 image tokens × hidden 5,120 (v41) × 4 bytes = 160 MiB of fp32 rows
(80 MiB bf16), plus the prompt's ids."""
_PLAN_ARRAYS = (
    "seqlens_q",
    "seqlens_k",
    "query_start",
    "state_slots",
    "block_tables",
    "inputs_pending",
    "input_ids",
    "positions",
    "ring_slots",
    "row_requests",
    "sample_rows",
    "num_sample_rows",
    "propose_drafts",
)


def to_array(a) -> pb.Array:
    arr = np.ascontiguousarray(a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a))
    return pb.Array(dtype=arr.dtype.name, shape=list(arr.shape), data=arr.astype(arr.dtype.newbyteorder("<")).tobytes())


def from_array(msg: pb.Array) -> np.ndarray:
    return np.frombuffer(msg.data, dtype=np.dtype(msg.dtype).newbyteorder("<")).reshape(tuple(msg.shape))


def tensor_to_array(t: torch.Tensor) -> pb.Array:
    """A float32 or bfloat16 tensor's bytes, shape and dtype name (bf16 has no numpy dtype: its 2 raw bytes)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return pb.Array(dtype="bfloat16", shape=list(t.shape), data=t.view(torch.int16).numpy().astype("<i2").tobytes())
    if t.dtype != torch.float32:
        raise ValueError(f"image rows must be float32 or bfloat16, got {t.dtype}")
    return to_array(t)


def array_to_tensor(msg: pb.Array) -> torch.Tensor:
    """``tensor_to_array``'s inverse; ValueError when the bytes do not fit the shape."""
    itemsize = {"bfloat16": 2, "float32": 4}.get(msg.dtype)
    if itemsize is None:
        raise ValueError(f"image rows must be float32 or bfloat16, got {msg.dtype!r}")
    shape = tuple(msg.shape)
    if len(msg.data) != int(np.prod(shape, dtype=np.int64)) * itemsize:
        raise ValueError(f"{len(msg.data)} bytes do not hold a {msg.dtype} array of shape {shape}")
    if msg.dtype == "float32":
        return torch.from_numpy(from_array(msg).copy())
    raw = np.frombuffer(msg.data, dtype="<i2").reshape(shape).copy()
    return torch.from_numpy(raw).view(torch.bfloat16)


def _int32(a) -> np.ndarray:
    return np.frombuffer(a, np.int32) if not isinstance(a, np.ndarray) else a.astype(np.int32)


@dataclass
class PlanView:
    """The StepPlan attributes a runner reads, rebuilt from the proto. Arrays are int32 numpy arrays."""

    step_id: int
    kind: str
    is_prefill: bool
    is_placeholder: bool
    request_ids: list[str]
    block_table_width: int
    entry_ratios: list[int]
    graph_size: int | None
    num_padding_rows: int
    arrays: dict[str, np.ndarray]  # by StepPlan attribute name
    entries: dict[int, tuple[np.ndarray, np.ndarray]]  # ratio -> (rows, slots)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    state_copies: list[tuple[int, int]] = field(default_factory=list)

    def __getattr__(self, name: str) -> np.ndarray:
        arrays = self.__dict__.get("arrays", {})
        if name in arrays:
            return arrays[name]
        raise AttributeError(name)

    @property
    def num_requests(self) -> int:
        return len(self.request_ids)

    @property
    def num_rows(self) -> int:
        return len(self.arrays["positions"])

    def entry_writes(self, ratio: int) -> tuple[np.ndarray, np.ndarray]:
        return self.entries[ratio]


def encode_plan(plan, rows: Sequence[SamplingRow]) -> pb.StepPlan:
    msg = pb.StepPlan(
        step_id=plan.step_id,
        kind=plan.kind,
        request_ids=list(plan.request_ids),
        is_prefill=plan.is_prefill,
        is_placeholder=plan.is_placeholder,
        block_table_width=plan.block_table_width,
        entry_ratios=list(plan.entry_ratios),
        num_padding_rows=plan.num_padding_rows,
    )
    if plan.graph_size is not None:
        msg.graph_size = plan.graph_size
    for name in _PLAN_ARRAYS:
        msg.arrays[name].CopyFrom(to_array(_int32(getattr(plan, name))))
    for ratio in plan.entry_ratios:
        entry_rows, entry_slots = plan.entry_writes(ratio)
        msg.arrays[f"entry_rows.{ratio}"].CopyFrom(to_array(_int32(entry_rows)))
        msg.arrays[f"entry_slots.{ratio}"].CopyFrom(to_array(_int32(entry_slots)))
    for name in ("block_copies", "state_copies"):
        pairs = np.asarray(getattr(plan, name), dtype=np.int32).reshape(-1, 2)
        msg.arrays[name].CopyFrom(to_array(pairs))
    for r in rows:
        row = msg.sampling_rows.add(
            temperature=r.temperature,
            top_p=r.top_p,
            seed=r.seed % 2**64,
            position=r.position,
            banned_token_ids=list(r.banned_token_ids),
            num_logprobs=r.num_logprobs,
            top_k=r.top_k,
        )
        if r.forced_top_k is not None:
            row.forced_top_k = r.forced_top_k
        if r.forced_token_id is not None:
            row.forced_token_id = r.forced_token_id
        row.logit_bias_ids.extend(t for t, _ in r.logit_bias)
        row.logit_bias_values.extend(v for _, v in r.logit_bias)
    return msg


def decode_plan(msg: pb.StepPlan) -> tuple[PlanView, list[SamplingRow]]:
    arrays = {name: from_array(a) for name, a in msg.arrays.items()}
    entries = {r: (arrays[f"entry_rows.{r}"], arrays[f"entry_slots.{r}"]) for r in msg.entry_ratios}
    pairs = {name: [tuple(p) for p in arrays.pop(name).tolist()] for name in ("block_copies", "state_copies")}
    view = PlanView(
        step_id=msg.step_id,
        kind=msg.kind,
        is_prefill=msg.is_prefill,
        is_placeholder=msg.is_placeholder,
        request_ids=list(msg.request_ids),
        block_table_width=msg.block_table_width,
        entry_ratios=list(msg.entry_ratios),
        graph_size=msg.graph_size if msg.HasField("graph_size") else None,
        num_padding_rows=msg.num_padding_rows,
        arrays=arrays,
        entries=entries,
        **pairs,
    )
    rows = [
        SamplingRow(
            temperature=r.temperature,
            top_k=r.top_k,
            top_p=r.top_p,
            seed=r.seed,
            position=r.position,
            forced_top_k=r.forced_top_k if r.HasField("forced_top_k") else None,
            banned_token_ids=tuple(r.banned_token_ids),
            num_logprobs=r.num_logprobs,
            forced_token_id=r.forced_token_id if r.HasField("forced_token_id") else None,
            logit_bias=tuple(zip(r.logit_bias_ids, r.logit_bias_values)),
        )
        for r in msg.sampling_rows
    ]
    return view, rows


def encode_output(out: WorkerOutput) -> pb.StepResult:
    msg = pb.StepResult(
        num_tokens=out.result.num_tokens,
        token_ids=out.result.token_ids,
        errors=out.result.errors,
        num_rows_computed=out.num_rows_computed,
        sampled=out.sampled is not None,
    )
    if out.sampled is not None:
        s = out.sampled
        for name, value in (
            ("logprobs", s.logprobs),
            ("top_token_ids", s.top_token_ids),
            ("top_logprobs", s.top_logprobs),
            ("sampled_token_ids", s.token_ids),
            ("sampled_errors", s.errors),
        ):
            getattr(msg, name).CopyFrom(to_array(value))
    if out.expert_counts is not None:
        msg.expert_counts.CopyFrom(to_array(out.expert_counts))
    return msg


def decode_output(msg: pb.StepResult) -> WorkerOutput:
    from scheduler_rs import StepResult

    sampled = None
    if msg.sampled:
        t = lambda a: torch.from_numpy(from_array(a).copy())  # noqa: E731
        sampled = SamplerOutput(
            token_ids=t(msg.sampled_token_ids),
            logprobs=t(msg.logprobs),
            top_token_ids=t(msg.top_token_ids),
            top_logprobs=t(msg.top_logprobs),
            errors=t(msg.sampled_errors),
        )
    counts = torch.from_numpy(from_array(msg.expert_counts).copy()) if msg.HasField("expert_counts") else None
    result = StepResult(list(msg.num_tokens), list(msg.token_ids), errors=list(msg.errors))
    return WorkerOutput(result, sampled, counts, msg.num_rows_computed)


def model_hashes(source) -> tuple[str, str]:
    """(config sha256, weights sha256). The weights' hash is that of ``source.weights_id`` (what fixes them:
    a seed, or a checkpoint's headers; model_source.weights_identity) when it has one, so neither side
    reads a large model's bytes and an engine without the weights can compare; else it hashes the
    weights' names, dtypes, shapes and bytes, in name order."""
    config = hashlib.sha256(json.dumps(asdict(source.config), sort_keys=True, default=str).encode()).hexdigest()
    if getattr(source, "weights_id", None) is not None:
        return config, hashlib.sha256(source.weights_id.encode()).hexdigest()
    h = hashlib.sha256()
    for name, tensor in sorted(source.model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return config, h.hexdigest()


class WorkerApi(worker_pb2_grpc.WorkerServicer):
    def __init__(self, worker, model_name: str, hashes: tuple[str, str], vocab_size: int) -> None:
        self.worker = worker
        self.info = pb.ModelInfo(
            model=model_name, config_sha256=hashes[0], weights_sha256=hashes[1], vocab_size=vocab_size
        )
        self._lock = threading.Lock()  # one step at a time: the runner's pools are not thread-safe
        self.registry = prom.CollectorRegistry()
        self.steps = prom.Counter(names.WORKER_STEPS, "steps executed", registry=self.registry)
        self.rows = prom.Counter(names.WORKER_ROWS, "rows the model ran", registry=self.registry)
        self.step_seconds = prom.Histogram(
            names.WORKER_STEP_SECONDS, "ExecuteStep time, decode to encode", registry=self.registry
        )

    def ExecuteStep(self, request: pb.StepPlan, context) -> pb.StepResult:
        # A span only under a traced (sampled) engine step: untraced steps carry no context and get none.
        parent = tracing.extract(context.invocation_metadata())
        span = (
            tracing.span("worker.execute_step", parent, kind=tracing.SpanKind.SERVER)
            if parent is not None
            else tracing.active(None)
        )
        with self.step_seconds.time(), span:
            plan, rows = decode_plan(request)
            with self._lock:
                out = self.worker.execute(plan, rows)
            self.steps.inc()
            self.rows.inc(out.num_rows_computed)
            return encode_output(out)

    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        with self._lock:
            self.worker.release(request.request_id)
        return pb.ReleaseResponse()

    def GetModelInfo(self, request: pb.GetModelInfoRequest, context) -> pb.ModelInfo:
        return self.info

    def SetImages(self, request: pb.SetImagesRequest, context) -> pb.SetImagesResponse:
        try:
            rows = array_to_tensor(request.rows)
            with self._lock:
                self.worker.set_images(request.request_id, list(request.prompt_token_ids), rows)
        except ValueError as err:  # rows that do not fit the prompt, or a model without a tower
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return pb.SetImagesResponse()
