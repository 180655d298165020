"""The engine's client of a worker in its own process (``worker.v1``): the same ``execute``/``release`` as
the in-process `Worker`, so `Engine` cannot tell them apart. Calls block: they run on the step thread.

At connect time the worker's config and weight hashes must equal the engine's own model's, or
`ModelMismatch` is raised: an engine never schedules for a different model.
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.proto.worker.v1 import worker_pb2 as pb
from services.proto.worker.v1 import worker_pb2_grpc
from services.worker.sampler import SamplingRow
from services.worker.service import decode_output, encode_plan, model_hashes
from services.worker.worker import WorkerOutput

MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a step's logprob arrays can be large


class ModelMismatch(RuntimeError):
    """The worker serves a different model (config or weights) than the engine."""


class RemoteWorker:
    def __init__(self, address: str, *, timeout_s: float = 600.0) -> None:
        self.address = address
        self.timeout_s = timeout_s  # per step
        options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
        self.channel = grpc.insecure_channel(address, options=options)
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)

    def check_model(self, source, connect_timeout_s: float = 60.0) -> pb.ModelInfo:
        """Waits for the worker, then compares its hashes with ``source``'s (a ModelSource)."""
        info = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=connect_timeout_s, wait_for_ready=True)
        config_sha, weights_sha = model_hashes(source)
        if (info.config_sha256, info.weights_sha256) != (config_sha, weights_sha):
            what = "config" if info.config_sha256 != config_sha else "weights"
            raise ModelMismatch(f"the worker at {self.address} serves model {info.model!r} with different {what} "
                                f"(sha256 {getattr(info, what + '_sha256')[:12]}…, engine "
                                f"{(config_sha if what == 'config' else weights_sha)[:12]}…)")
        return info

    def execute(self, plan, rows: Sequence[SamplingRow]) -> WorkerOutput:
        return decode_output(self.stub.ExecuteStep(encode_plan(plan, rows), timeout=self.timeout_s))

    def release(self, request_id: str) -> None:
        self.stub.Release(pb.ReleaseRequest(request_id=request_id), timeout=self.timeout_s)

    def close(self) -> None:
        self.channel.close()
