"""The stack's Kubernetes objects (services/entrypoints/kubernetes.py writes them): each stack service a Deployment
of one pod running the same argv as under `shinkai up` (restart policy ``Always``: the kubelet restarts a crashed
container, with its own backoff) and a Service of the same name, by which the others reach it (`ContainerPlacement`).
Probes use grpc.health.v1, which stays open without the service credential; the gateway's readiness is
``GET /ready``. Secrets come from one Secret, ``shinkai-secrets``, made from the same ``.env`` compose reads; each
container references only its own keys (`compose.secret_sources`). A NetworkPolicy lets pods of the stack reach
each other and anyone reach the gateway only. nats runs the official image with the generated config from a
ConfigMap.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from services import nats_auth
from services.entrypoints.compose import (
    COMPILE_CACHE_MOUNT,
    CONFIG,
    IMAGE,
    NATS_CONFIG,
    NATS_IMAGE,
    PORTS,
    nats_users,
    secret_sources,
    stack_services,
)
from services.entrypoints.service_list import Service
from services.entrypoints.stack_config import StackConfig
from services.gateway.auth import KEY_ENV

SECRET = "shinkai-secrets"  # kubectl create secret generic shinkai-secrets --from-env-file=deploy/.env
NATS_CONFIG_MAP = "shinkai-nats-config"
PART_OF = {"app.kubernetes.io/part-of": "shinkai"}  # on every object and pod of the stack


def labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, **PART_OF}


def _ports(service: Service) -> dict[str, int]:
    """The named ports ``service`` listens on (fixed inside its pod, as under compose)."""
    if service.name == "nats":
        return {"client": PORTS["client"], "monitor": 8222}
    ports = {"grpc": PORTS["grpc"]}
    if "--metrics-port" in service.argv:
        ports["metrics"] = PORTS["metrics"]
    if service.name == "gateway":
        ports["http"] = PORTS["http"]
    if service.group is not None and service.name.endswith("-0"):  # a group's rank 0 hosts its rendezvous
        ports["rendezvous"] = PORTS["rendezvous"]
    return ports


def container_env(service: Service, users: list[str]) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = []
    if service.name != "nats":
        env += [
            {"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://otel-collector:4317"},
            {"name": "OTEL_SERVICE_NAME", "value": f"shinkai-{service.name}"},
            {"name": "HF_HUB_OFFLINE", "value": "1"},
        ]
        if service.name in users:
            env.append({"name": nats_auth.USER_ENV, "value": service.name})
    for variable, key in secret_sources(service.name, users).items():
        ref: dict[str, Any] = {"name": SECRET, "key": key}
        if key == KEY_ENV:
            ref["optional"] = True  # no key: the gateway is open
        env.append({"name": variable, "valueFrom": {"secretKeyRef": ref}})
    return env


def probes(service: Service) -> dict[str, Any]:
    """Alive: the main port accepts connections (a service that is up but NOT_SERVING, as an engine whose worker
    is gone or a gateway with no engine, is waiting for another, not broken: restarting it would not help).
    Ready: grpc.health.v1 SERVING, or for the gateway ``GET /ready``."""
    port = PORTS["client"] if service.name == "nats" else PORTS["grpc"]
    alive = {"tcpSocket": {"port": port}, "periodSeconds": 5, "timeoutSeconds": 3}
    probes: dict[str, Any] = {
        # up to 10 minutes to bind (an engine binds before it loads: NOT_SERVING with its phase until built)
        "startupProbe": {**alive, "failureThreshold": 120},
        "livenessProbe": {**alive, "failureThreshold": 6},
        "readinessProbe": alive,
    }
    if service.name != "nats":
        probes["readinessProbe"] = {"grpc": {"port": PORTS["grpc"]}, "periodSeconds": 5, "timeoutSeconds": 3}
    if service.name == "gateway":  # ready: a real one-token generation through engine and worker
        probes["readinessProbe"] = {
            "httpGet": {"path": "/ready", "port": PORTS["http"]},
            "periodSeconds": 5,
            "timeoutSeconds": 10,
        }
    return probes


def _deployment(service: Service, users: list[str]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": service.name,
        "image": NATS_IMAGE if service.name == "nats" else IMAGE,
        "args": service.argv,  # after the image's entrypoint, as compose's `command`
        "env": container_env(service, users),
        "ports": [{"name": n, "containerPort": p} for n, p in _ports(service).items()],
        **probes(service),
    }
    pod: dict[str, Any] = {
        "restartPolicy": "Always",
        "terminationGracePeriodSeconds": 40,  # the services' own drain timeout is 30 s
        "containers": [container],
    }
    if service.name == "nats":
        container["volumeMounts"] = [{"name": "config", "mountPath": str(Path(NATS_CONFIG).parent), "readOnly": True}]
        pod["volumes"] = [{"name": "config", "configMap": {"name": NATS_CONFIG_MAP}}]
    if service.name.startswith(("engine-", "worker-")):  # they compile kernels: a restarted container starts warm
        # (the pod's emptyDir outlives its containers; a new pod starts cold)
        container["env"].append({"name": "SHINKAI_CACHE_DIR", "value": COMPILE_CACHE_MOUNT})
        container["volumeMounts"] = [{"name": "compile-cache", "mountPath": COMPILE_CACHE_MOUNT}]
        pod["volumes"] = [{"name": "compile-cache", "emptyDir": {}}]
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": service.name, "labels": labels(service.name)},
        "spec": {
            "replicas": 1,
            "strategy": {"type": "Recreate"},  # one pod per service: the old one goes before the new one binds
            "selector": {"matchLabels": {"app.kubernetes.io/name": service.name}},
            "template": {"metadata": {"labels": labels(service.name)}, "spec": pod},
        },
    }


def _service(service: Service) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service.name, "labels": labels(service.name)},
        "spec": {
            "selector": {"app.kubernetes.io/name": service.name},
            "ports": [{"name": n, "port": p, "targetPort": n} for n, p in _ports(service).items()],
            # Inside the stack each service judges its peers' health itself (heartbeats, health polls), as under
            # compose; only the gateway's Service follows readiness.
            "publishNotReadyAddresses": service.name != "gateway",
        },
    }


def _network_policies() -> list[dict[str, Any]]:
    """Pods of the stack take connections from each other only; the gateway's from anywhere."""
    return [
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "shinkai-internal", "labels": PART_OF},
            "spec": {
                "podSelector": {"matchLabels": PART_OF},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"podSelector": {"matchLabels": PART_OF}}]}],
            },
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "shinkai-gateway-public", "labels": PART_OF},
            "spec": {
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "gateway"}},
                "policyTypes": ["Ingress"],
                "ingress": [{"ports": [{"port": PORTS["http"]}, {"port": PORTS["grpc"]}]}],
            },
        },
    ]


def manifests(config: StackConfig = CONFIG) -> list[dict[str, Any]]:
    """Every object, in apply order."""
    users = [u.name for u in nats_users(config)]
    objects: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": NATS_CONFIG_MAP, "labels": PART_OF},
            "data": {Path(NATS_CONFIG).name: nats_auth.config(nats_users(config))},
        },
        *_network_policies(),
    ]
    for service in stack_services(config):
        objects += [_deployment(service, users), _service(service)]
    return objects
