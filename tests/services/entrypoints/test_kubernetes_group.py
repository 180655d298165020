"""deploy/kubernetes-multihost.yaml: generated from the stack's service list and up to date; its built-in kinds valid
for the Kubernetes API (kubernetes-validate, strict), its LeaderWorkerSet valid against the CRD schema vendored from
LWS v0.10.0 (jsonschema; a missing schema fails); every rank of the service list runs its own command in its pod,
placed by torchrun as that rank (its rank, device, ports and NATS user), and is reached by its Service on the
stack's ports; every other service is the one-host manifest's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from torch.distributed.run import get_args_parser

from services import nats_auth
from services.entrypoints import kubernetes
from services.entrypoints.compose import DEPLOY, PORTS, stack_services
from services.entrypoints.engine import apply_launcher_place, parser
from services.entrypoints.kubernetes_group import (
    GROUP_CONFIG,
    PATH,
    RANKS_PER_HOST,
    host_group,
    multihost_manifests,
    render,
    unplaced,
)
from services.entrypoints.stack_config import StackConfig

LWS_SCHEMA = DEPLOY / "schemas" / "leaderworkerset-v0.10.0.json"
KUBERNETES_VERSION = "1.33.0"  # the API version the built-in kinds are checked against


def objects() -> list[dict]:
    return [o for o in yaml.safe_load_all(PATH.read_text()) if o is not None]


def by_kind() -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for obj in objects():
        out.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    return out


def test_the_file_is_up_to_date_and_reads_back_as_the_generators_objects():
    assert PATH.read_text() == render(), f"{PATH} is stale: run python -m services.entrypoints.kubernetes"
    assert objects() == multihost_manifests()
    assert kubernetes.main(["--check"]) == 0


@pytest.mark.parametrize("path", [kubernetes.PATH, PATH], ids=lambda p: Path(p).name)
def test_built_in_kinds_are_valid_kubernetes_objects(path):
    docs = [o for o in yaml.safe_load_all(Path(path).read_text()) if o is not None]
    built_in = [o for o in docs if o["kind"] != "LeaderWorkerSet"]
    assert len(built_in) >= len(docs) - 1
    for obj in built_in:
        kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises naming the field


def test_the_leader_worker_set_is_valid_against_the_vendored_crd_schema():
    assert LWS_SCHEMA.is_file(), f"the LeaderWorkerSet schema is missing: {LWS_SCHEMA}"
    schema = json.loads(LWS_SCHEMA.read_text())
    assert "v0.10.0" in schema["$comment"]
    (lws,) = by_kind()["LeaderWorkerSet"].values()
    jsonschema.validate(lws, schema)
    bad = json.loads(json.dumps(lws))
    bad["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Sometimes"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    # The CRD's schema lets unknown fields through (the API server prunes them): the pod templates also pass the
    # built-in PodTemplate's strict schema, which refuses them.
    for name in ("leaderTemplate", "workerTemplate"):
        template = lws["spec"]["leaderWorkerTemplate"][name]
        pod = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name.lower()}, "template": template}
        kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)
        pod["template"]["spec"]["containers"][0]["portz"] = []
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(pod, KUBERNETES_VERSION, strict=True)


def launched(pod_args: list[str], node_rank: int, local_rank: int, nproc: int, size: int) -> tuple:
    """What torchrun on host ``node_rank`` gives its ``local_rank``-th engine process: (torchrun's parsed
    flags, the engine's flags after it took its place, its environment)."""
    env = {"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(node_rank), "LWS_LEADER_ADDRESS": "engine-0.engine"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in pod_args]
    assert argv[:3] == ["python", "-m", "torch.distributed.run"]
    run = get_args_parser().parse_args(argv[3:])
    rank = run.node_rank * int(run.nproc_per_node) + local_rank
    environ = {
        "RANK": str(rank),
        "WORLD_SIZE": str(int(run.nnodes) * int(run.nproc_per_node)),
        "LOCAL_RANK": str(local_rank),
        "MASTER_ADDR": run.master_addr,
        "MASTER_PORT": str(run.master_port),
        **{nats_auth.password_env(f"engine-{r}"): f"secret-{r}" for r in range(nproc * size)},
    }
    args = parser().parse_args(run.training_script_args)
    assert apply_launcher_place(args, environ)
    return run, args, environ


def test_every_rank_runs_its_stack_command_placed_by_the_launcher():
    kinds = by_kind()
    (lws,) = kinds["LeaderWorkerSet"].values()
    template = lws["spec"]["leaderWorkerTemplate"]
    group = host_group()
    assert template["size"] == group.num_hosts == GROUP_CONFIG.data_parallel_size // RANKS_PER_HOST
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"  # a lost host restarts the whole group
    for node_rank in range(group.num_hosts):
        pod = template["leaderTemplate" if node_rank == 0 else "workerTemplate"]["spec"]
        (container,) = pod["containers"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == RANKS_PER_HOST
        container_ports = {p["containerPort"] for p in container["ports"]}
        assert (PORTS["rendezvous"] in container_ports) == (node_rank == 0)  # torchrun's store: the leader's
        env_names = {e["name"] for e in container["env"]}
        for local in range(RANKS_PER_HOST):
            run, args, environ = launched(container["args"], node_rank, local, RANKS_PER_HOST, group.num_hosts)
            rank = node_rank * RANKS_PER_HOST + local
            service = group.ranks[rank]
            assert service.name == f"engine-{rank}" and run.module
            assert run.training_script == "services.entrypoints.engine"
            assert run.master_addr == "engine-0.engine" and run.master_port == PORTS["rendezvous"]
            # the stack's command for this rank, less its place, which the launcher gave
            assert run.training_script_args[:-1] == unplaced(service.argv)[3:]
            stack = parser().parse_args(service.argv[3:])
            assert (args.dp_rank, args.data_parallel_size, args.rank, args.replica) == (
                stack.dp_rank,
                stack.data_parallel_size,
                stack.rank,
                stack.replica,
            )
            assert args.grpc_port == PORTS["grpc"] + local and args.metrics_port == PORTS["metrics"] + local
            assert {args.grpc_port, args.metrics_port} <= container_ports
            assert args.device == f"cuda:{local}"
            assert environ[nats_auth.USER_ENV] == service.name and environ[nats_auth.PASSWORD_ENV] == f"secret-{rank}"
            assert nats_auth.password_env(service.name) in env_names
            # its Service reaches this pod on the stack's ports, mapped to this rank's
            svc = kinds["Service"][service.name]["spec"]
            assert svc["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == str(node_rank)
            assert {p["port"]: p["targetPort"] for p in svc["ports"]} == {
                PORTS["grpc"]: args.grpc_port,
                PORTS["metrics"]: args.metrics_port,
            }


def test_every_other_service_is_the_one_host_manifests_and_every_address_is_a_service():
    kinds = by_kind()
    ranks = {s.name for s in host_group().ranks}
    one_host = {(o["kind"], o["metadata"]["name"]): o for o in kubernetes.manifests(GROUP_CONFIG)}
    others = [s for s in stack_services(GROUP_CONFIG) if s.name not in ranks]
    assert set(kinds["Deployment"]) == {s.name for s in others}
    assert set(kinds["Service"]) == {s.name for s in others} | ranks
    for s in others:
        assert kinds["Deployment"][s.name] == one_host[("Deployment", s.name)]
    for s in stack_services(GROUP_CONFIG):  # every address a command names is a Service
        for host in re.findall(r"(?:nats://|tcp://)?([a-z][a-z0-9-]*):\d+", " ".join(s.argv)):
            if s.name not in ranks or host != "engine-0":  # a rank's own rendezvous is the launcher's
                assert host in kinds["Service"], (s.name, host)


def test_the_multihost_secrets_file_has_every_key_the_manifest_references(tmp_path):
    path = tmp_path / ".env"
    assert kubernetes.main(["--multihost-secrets", str(path)]) == 0
    assert kubernetes.main(["--multihost-secrets", str(path)]) == 1  # kept: its secrets may be in use
    provided = {line.split("=", 1)[0] for line in path.read_text().splitlines()}
    refs: set[str] = set()

    def walk(value):
        if isinstance(value, dict):
            ref = value.get("secretKeyRef")
            if ref is not None and not ref.get("optional"):
                refs.add(ref["key"])
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)

    walk(objects())
    assert {nats_auth.password_env(f"engine-{r}") for r in range(GROUP_CONFIG.data_parallel_size)} <= refs
    assert refs <= provided


@pytest.mark.parametrize(
    ("config", "per_host", "message"),
    [
        (StackConfig(data_parallel_size=4, remote_workers=True), 2, "remote_workers"),
        (StackConfig(data_parallel_size=4), 3, "do not split"),
        (StackConfig(), 1, "do not split"),
    ],
)
def test_a_stack_that_cannot_be_placed_is_refused(config, per_host, message):
    with pytest.raises(ValueError, match=message):
        host_group(config, per_host)
