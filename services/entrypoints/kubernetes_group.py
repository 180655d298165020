"""`deploy/kubernetes-multihost.yaml`: the stack with its data-parallel engine group spread over several hosts, as
a LeaderWorkerSet (sigs.k8s.io/lws), generated from the same service list as `deploy/kubernetes.yaml`.

    python -m services.entrypoints.kubernetes            # rewrites both files
    python -m services.entrypoints.kubernetes --check    # exit 1 if either is not what the service list gives

Everything but the group is what `services/entrypoints/kubernetes_objects.py` makes of the service list (a
Deployment and a Service each). The group's ranks ``engine-0 … engine-(N−1)`` become one LeaderWorkerSet
``engine`` of N / P pods, P GPUs each: the leader (worker index 0) holds ranks 0 … P−1, worker k ranks
kP … kP+P−1. Every pod runs torchrun with one engine process per GPU (`services/engine/parallel/rank_place.py`),
its node rank and the master from the variables LWS gives each pod (``LWS_WORKER_INDEX``, ``LWS_GROUP_SIZE``,
``LWS_LEADER_ADDRESS``); the ranks meet at torchrun's store on the leader. Each rank runs the stack's own command
for it less the flags that place it (its rank, the group's size, the rendezvous), which the launcher gives; local
rank l serves on the pod's ports plus l.

A Service ``engine-R`` per rank selects rank R's pod and maps the stack's ports to that rank's, so the gateway's
and planner's commands reach the ranks by the same names as under compose. LWS recreates the whole group when
any of its pods restarts (``RecreateGroupOnPodRestart``): a lost host loses the group (its ranks exit once their
collectives fail), and the group starts again together. Each pod holds the NATS passwords of every rank of the
group (a worker pod's template cannot know its ranks); a rank connects as its own user.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services import nats_auth, service_auth
from services.entrypoints.compose import DEPLOY, IMAGE, PORTS, stack_services, to_yaml
from services.entrypoints.kubernetes_objects import SECRET, labels, manifests, probes
from services.entrypoints.service_list import Service
from services.entrypoints.stack_config import StackConfig

# The configuration the multi-host manifest describes: 16 ranks over 2 hosts of 8 GPUs (EP16), v41-s1 at full
# depth with random weights drawn on each GPU (for a checkpoint, mount it and set --model /models/DIR).
GROUP_CONFIG = StackConfig(
    model="v41-s1",
    data_parallel_size=16,
    max_num_seqs=64,
    device_args=(("device", "cuda"), ("gpu_memory_utilization", 0.9), ("load_format", "dummy")),
)
RANKS_PER_HOST = 8  # GPUs per pod: torchrun's --nproc-per-node
PATH = DEPLOY / "kubernetes-multihost.yaml"
GROUP = "engine"  # the LeaderWorkerSet's name: its pods engine-0 (leader), engine-0-1, …; its headless Service
# The flags that place a rank, with their values: under a launcher each rank takes them from its environment.
PLACE_FLAGS = ("--replica", "--rank", "--dp", "--dp-rank", "--dp-rendezvous")
LWS_API = "leaderworkerset.x-k8s.io/v1"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"  # LWS's labels on every pod of the set
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
LWS_WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


@dataclass(frozen=True)
class HostGroup:
    ranks: list[Service]  # the group's ranks from the service list, rank order
    ranks_per_host: int  # ranks (GPUs) per pod

    @property
    def num_hosts(self) -> int:
        return len(self.ranks) // self.ranks_per_host


def host_group(config: StackConfig = GROUP_CONFIG, ranks_per_host: int = RANKS_PER_HOST) -> HostGroup:
    """The service list's data-parallel group, split over hosts; ValueError for a stack this cannot place."""
    if config.remote_workers:
        raise ValueError("a multi-host group runs its workers in the engine processes (remote_workers=False)")
    if config.num_engines != 1:
        raise ValueError(f"one data-parallel group per stack, not num_engines={config.num_engines}")
    ranks = [s for s in stack_services(config) if s.group is not None]
    if len(ranks) < 2 or ranks_per_host < 1 or len(ranks) % ranks_per_host:
        raise ValueError(f"{len(ranks)} ranks do not split into hosts of {ranks_per_host} (data_parallel_size ≥ 2)")
    return HostGroup(ranks, ranks_per_host)


def unplaced(argv: list[str]) -> list[str]:
    """``argv`` without the flags that place a rank (``PLACE_FLAGS``, each with its value)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in PLACE_FLAGS:
            skip = True
        elif not arg.startswith(tuple(f"{f}=" for f in PLACE_FLAGS)):
            out.append(arg)
    return out


def launcher_argv(group: HostGroup) -> list[str]:
    """A pod's command: torchrun around the command every rank shares (ValueError if the ranks' differ)."""
    shared = {tuple(unplaced(s.argv)) for s in group.ranks}
    if len(shared) != 1:
        raise ValueError(f"the group's ranks differ in more than their place: {sorted(shared)}")
    python, m, module, *flags = next(iter(shared))
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nnodes=$(LWS_GROUP_SIZE)",
        "--node-rank=$(LWS_WORKER_INDEX)",
        f"--nproc-per-node={group.ranks_per_host}",
        "--master-addr=$(LWS_LEADER_ADDRESS)",
        f"--master-port={PORTS['rendezvous']}",
        m,
        module,
        *flags,
        "--dp-rendezvous=env://",
    ]


def _pod(group: HostGroup, leader: bool) -> dict[str, Any]:
    ports = [
        {"name": f"{what}-{local}", "containerPort": PORTS[what] + local}
        for local in range(group.ranks_per_host)
        for what in ("grpc", "metrics")
    ]
    if leader:  # torchrun's store, where the group meets
        ports.append({"name": "rendezvous", "containerPort": PORTS["rendezvous"]})
    container: dict[str, Any] = {
        "name": GROUP,
        "image": IMAGE,
        "args": launcher_argv(group),
        "env": _env(group),
        "ports": ports,
        "resources": {"limits": {"nvidia.com/gpu": group.ranks_per_host}},
        "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}],  # NCCL's and the Engram tables' shared memory
        **probes(group.ranks[0]),  # local rank 0's ports: the pod is alive and ready with it
    }
    return {
        "metadata": {"labels": labels(GROUP)},
        "spec": {
            "restartPolicy": "Always",
            "terminationGracePeriodSeconds": 40,  # the ranks' own drain timeout is 30 s
            "containers": [container],
            "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
        },
    }


def _env(group: HostGroup) -> list[dict[str, Any]]:
    """Telemetry, the service credential, and every rank's NATS password (each rank picks its own by its name)."""
    env: list[dict[str, Any]] = [
        {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector:4317"},
        {"name": "OTEL_SERVICE_NAME", "value": f"shinkai-{GROUP}"},
        {"name": "HF_HUB_OFFLINE", "value": "1"},
        {
            "name": service_auth.TOKEN_ENV,
            "valueFrom": {"secretKeyRef": {"name": SECRET, "key": service_auth.TOKEN_ENV}},
        },
    ]
    for rank in group.ranks:
        key = nats_auth.password_env(rank.name)
        env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": key}}})
    return env


def leader_worker_set(group: HostGroup) -> dict[str, Any]:
    return {
        "apiVersion": LWS_API,
        "kind": "LeaderWorkerSet",
        "metadata": {"name": GROUP, "labels": labels(GROUP)},
        "spec": {
            "replicas": 1,  # one group: its ranks are the stack's engines
            "startupPolicy": "LeaderCreated",  # every pod at once: each waits for the others at the rendezvous
            "leaderWorkerTemplate": {
                "size": group.num_hosts,
                "restartPolicy": "RecreateGroupOnPodRestart",
                "leaderTemplate": _pod(group, leader=True),
                "workerTemplate": _pod(group, leader=False),
            },
        },
    }


def rank_service(group: HostGroup, rank: int) -> dict[str, Any]:
    """``engine-R``: rank R's pod, the stack's ports mapped to that rank's."""
    host, local = divmod(rank, group.ranks_per_host)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": group.ranks[rank].name, "labels": labels(group.ranks[rank].name)},
        "spec": {
            "selector": {LWS_NAME_LABEL: GROUP, LWS_GROUP_LABEL: "0", LWS_WORKER_LABEL: str(host)},
            "ports": [{"name": w, "port": PORTS[w], "targetPort": PORTS[w] + local} for w in ("grpc", "metrics")],
            "publishNotReadyAddresses": True,  # the gateway judges the ranks' health itself
        },
    }


def multihost_manifests(config: StackConfig = GROUP_CONFIG, ranks_per_host: int = RANKS_PER_HOST) -> list[dict]:
    """Every object, in apply order: the one-host manifests less the ranks' Deployments and Services, then the
    group's LeaderWorkerSet and a Service per rank."""
    group = host_group(config, ranks_per_host)
    names = {s.name for s in group.ranks}
    objects = [o for o in manifests(config) if o["metadata"]["name"] not in names]
    return [
        *objects,
        leader_worker_set(group),
        *(rank_service(group, r) for r in range(len(group.ranks))),
    ]


def render(config: StackConfig = GROUP_CONFIG, ranks_per_host: int = RANKS_PER_HOST) -> str:
    header = (
        "# Generated by `python -m services.entrypoints.kubernetes` from services/entrypoints/service_list.py; "
        "do not edit.\n"
        "# Needs the LeaderWorkerSet controller (sigs.k8s.io/lws v0.10.0) and the NVIDIA device plugin.\n"
    )
    return header + "".join(f"---\n{to_yaml(obj)}\n" for obj in multihost_manifests(config, ranks_per_host))
