"""deploy/kubernetes.yaml: generated from the stack's service list and up to date, it reads back as the objects
the generator made, every container runs the stack's command and is reached by a Service of its name, its
probes leave a service that waits for a peer alive, and each container references only its own secrets, all
of which the `.env` that compose reads provides."""

import re

import yaml

from services.entrypoints.compose import nats_users, secret_variables, stack_services, write_secrets
from services.entrypoints.kubernetes import PATH, SECRET, manifests, render


def objects_by_kind() -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for obj in yaml.safe_load_all(PATH.read_text()):
        out.setdefault(obj["kind"], {})[obj["metadata"]["name"]] = obj
    return out


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def test_the_file_is_up_to_date_and_reads_back_as_the_generators_objects():
    assert PATH.read_text() == render(), f"{PATH} is stale: run python -m services.entrypoints.kubernetes"
    assert [o for o in yaml.safe_load_all(PATH.read_text()) if o is not None] == manifests()


def test_every_service_is_a_deployment_running_the_stacks_command_behind_a_service_of_its_name():
    kinds = objects_by_kind()
    stack = stack_services()
    assert set(kinds["Deployment"]) == set(kinds["Service"]) == {s.name for s in stack}
    for s in stack:
        deployment = kinds["Deployment"][s.name]
        pod = deployment["spec"]["template"]
        assert container(deployment)["args"] == s.argv, s.name
        assert pod["spec"]["restartPolicy"] == "Always"  # the kubelet restarts a crashed container
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert kinds["Service"][s.name]["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
        named = {p["name"] for p in container(deployment)["ports"]}
        assert {p["targetPort"] for p in kinds["Service"][s.name]["spec"]["ports"]} == named
    for s in stack:  # every address a command names is a Service
        for host in re.findall(r"(?:nats://|tcp://)?([a-z][a-z0-9-]*):\d+", " ".join(s.argv)):
            assert host in kinds["Service"], (s.name, host)


def test_probes_restart_a_dead_process_not_one_waiting_for_a_peer():
    kinds = objects_by_kind()
    for name, deployment in kinds["Deployment"].items():
        c = container(deployment)
        assert "tcpSocket" in c["livenessProbe"] and "tcpSocket" in c["startupProbe"], name
        if name == "gateway":
            assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
        elif name != "nats":
            assert c["readinessProbe"]["grpc"]["port"] == 50051, name  # grpc.health.v1: open without a credential
    published = {n for n, s in kinds["Service"].items() if not s["spec"]["publishNotReadyAddresses"]}
    assert published == {"gateway"}


def test_each_container_references_only_its_own_secrets_and_the_env_file_has_them_all(tmp_path):
    kinds = objects_by_kind()
    path = write_secrets(tmp_path / ".env")
    provided = {line.split("=", 1)[0] for line in path.read_text().splitlines()}
    assert provided == set(secret_variables())
    users = {u.name for u in nats_users()}
    for name, deployment in kinds["Deployment"].items():
        refs = {
            e["name"]: e["valueFrom"]["secretKeyRef"]
            for e in container(deployment)["env"]
            if "valueFrom" in e and e["valueFrom"]["secretKeyRef"]["name"] == SECRET
        }
        keys = {r["key"] for r in refs.values()}
        required = {r["key"] for r in refs.values() if not r.get("optional")}
        assert required <= provided, name
        assert ("SHINKAI_API_KEY" in keys) == (name == "gateway"), name
        passwords = {k for k in keys if k.startswith("SHINKAI_NATS_PASSWORD_")}
        if name == "nats":
            assert passwords == {f"SHINKAI_NATS_PASSWORD_{u.upper().replace('-', '_')}" for u in users}
            assert "SHINKAI_SERVICE_TOKEN" not in keys
        else:
            assert "SHINKAI_SERVICE_TOKEN" in keys, name
            own = {f"SHINKAI_NATS_PASSWORD_{name.upper().replace('-', '_')}"} if name in users else set()
            assert passwords == own, name


def test_only_the_gateway_takes_connections_from_outside_the_stack():
    policies = objects_by_kind()["NetworkPolicy"]
    internal = policies["shinkai-internal"]["spec"]
    assert internal["podSelector"]["matchLabels"] == {"app.kubernetes.io/part-of": "shinkai"}
    assert internal["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"app.kubernetes.io/part-of": "shinkai"}}}]}
    ]
    opened = [p["spec"]["podSelector"]["matchLabels"] for n, p in policies.items() if n != "shinkai-internal"]
    assert opened == [{"app.kubernetes.io/name": "gateway"}]
