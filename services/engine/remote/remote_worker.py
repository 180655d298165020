"""The engine's client of a worker in its own process (``worker.v1``): the same ``execute``/``release`` as
the in-process `Worker`, so `Engine` cannot tell them apart. Calls block: they run on the step thread.

At connect time the worker's config and weight hashes must equal the engine's own model's, or
`ModelMismatch` is raised: an engine never schedules for a different model.

A step whose worker dies (the call fails) or stops answering its heartbeat (`WorkerHeartbeat`) raises
`WorkerLost` promptly; the engine's step loop then ends that step's requests with "error". ``release``
never raises. A request released while the worker does not answer is released again before the next step it
answers: a worker that died has dropped the state anyway, but one that only stalled (SIGSTOP, a wedged device)
still holds it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc

from observability import tracing
from services import service_auth
from services.engine.remote.heartbeat import WorkerHeartbeat
from services.proto.worker.v1 import worker_pb2 as pb
from services.proto.worker.v1 import worker_pb2_grpc
from services.worker.sampling.sampler import SamplingRow
from services.worker.service import MAX_MESSAGE_BYTES, decode_output, encode_plan, model_hashes, tensor_to_array
from services.worker.worker_output import WorkerOutput

log = logging.getLogger("shinkai.engine.remote_worker")


class WorkerLost(RuntimeError):
    """The worker failed the step, or stopped answering its heartbeat while it held one."""


class ModelMismatch(RuntimeError):
    """The worker serves a different model (config or weights) than the engine."""


class RemoteWorker:
    in_process = False  # worker.v1 carries plans and sampling rows only (StepWorker.in_process)

    def __init__(
        self, address: str, *, timeout_s: float = 600.0, heartbeat_s: float = 0.5, heartbeat_timeout_s: float = 3.0
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s  # per step
        options = [
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ]
        self.channel = service_auth.channel(address, options=options)  # the stack's service credential
        self.stub = worker_pb2_grpc.WorkerStub(self.channel)
        self.heartbeat = WorkerHeartbeat(self.channel, address, interval_s=heartbeat_s, timeout_s=heartbeat_timeout_s)
        self.unreleased: set[str] = set()  # released while the worker did not answer; sent before its next step

    def check_model(self, source, connect_timeout_s: float = 60.0) -> pb.ModelInfo:
        """Waits for the worker, then compares its hashes with ``source``'s (a ModelSource)."""
        info = self.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=connect_timeout_s, wait_for_ready=True)
        config_sha, weights_sha = model_hashes(source)
        if (info.config_sha256, info.weights_sha256) != (config_sha, weights_sha):
            what = "config" if info.config_sha256 != config_sha else "weights"
            raise ModelMismatch(
                f"the worker at {self.address} serves model {info.model!r} with different {what} "
                f"(sha256 {getattr(info, what + '_sha256')[:12]}…, engine "
                f"{(config_sha if what == 'config' else weights_sha)[:12]}…)"
            )
        self.heartbeat.start()  # watched from the first time it is known to serve the engine's model
        return info

    @property
    def alive(self) -> bool:
        return self.heartbeat.alive

    @property
    def num_losses(self) -> int:
        """Heartbeat checks the worker has failed, ever: a worker process that was restarted failed some (its
        pools came back empty), so what the engine cached in the old one's memory is gone."""
        return self.heartbeat.num_missed

    def answering_for(self) -> float:
        """Seconds the worker has answered its heartbeat without a miss (``WorkerHeartbeat.answering_for``)."""
        return self.heartbeat.answering_for()

    def execute(self, plan, rows: Sequence[SamplingRow]) -> WorkerOutput:
        if not self.heartbeat.alive:
            raise WorkerLost(f"the worker at {self.address} is not answering its heartbeat")
        for request_id in sorted(self.unreleased):
            self.release(request_id)
        call = self.stub.ExecuteStep.future(
            encode_plan(plan, rows), timeout=self.timeout_s, metadata=tracing.grpc_metadata()
        )  # a traced step's context
        poll_s = self.heartbeat.interval_s
        while True:
            try:
                return decode_output(call.result(timeout=poll_s))
            except grpc.FutureTimeoutError:
                if not self.heartbeat.alive:  # died or hung holding the step: do not wait for the deadline
                    call.cancel()
                    raise WorkerLost(
                        f"the worker at {self.address} stopped answering its heartbeat during step {plan.step_id}"
                    ) from None
            except grpc.RpcError as err:
                if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    self.heartbeat.mark_lost()  # the process is gone: refuse work until it answers again
                raise WorkerLost(
                    f"the worker at {self.address} failed step {plan.step_id}: {err.code().name} {err.details()}"
                ) from None

    def set_images(self, request_id: str, prompt_token_ids: list[int], rows) -> None:
        """``Worker.set_images`` over worker.v1: rows [P, D] float32 or bfloat16 travel as their bytes.
        ValueError when the worker refuses them (INVALID_ARGUMENT); WorkerLost when it cannot be reached."""
        if not self.heartbeat.alive:
            raise WorkerLost(f"the worker at {self.address} is not answering its heartbeat")
        request = pb.SetImagesRequest(
            request_id=request_id, prompt_token_ids=list(prompt_token_ids), rows=tensor_to_array(rows)
        )
        try:
            self.stub.SetImages(request, timeout=self.timeout_s, metadata=tracing.grpc_metadata())
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"the worker at {self.address} refused the image rows: {err.details()}") from None
            raise WorkerLost(
                f"the worker at {self.address} failed SetImages for {request_id}: {err.code().name} {err.details()}"
            ) from None

    def release(self, request_id: str) -> None:
        if not self.heartbeat.alive:
            self.unreleased.add(request_id)  # do not wait on a lost worker once per request: again when it answers
            return
        try:
            self.stub.Release(pb.ReleaseRequest(request_id=request_id), timeout=min(self.timeout_s, 5.0))
        except grpc.RpcError as err:
            log.warning(
                "release of %s on %s failed (%s); a lost worker has dropped it anyway",
                request_id,
                self.address,
                err.code().name,
            )
        self.unreleased.discard(request_id)

    def close(self) -> None:
        self.heartbeat.stop()
        self.channel.close()
