"""NATS credentials: one NATS user per service, each with its own generated password and subject permissions, so
a leaked credential of one service cannot speak for another.

The users (`stack_users`):
- ``engine-N`` publishes only its own subjects (`subjects.of_replica`: load, lifecycle, expert load) and
  subscribes to the planner's plans;
- ``gateway`` publishes nothing and subscribes to every engine's load and lifecycle subjects;
- ``eplb`` (the planner) subscribes to every engine's expert loads and publishes plans;
- ``observer`` publishes nothing and subscribes to everything: for operators and tests watching the stack.

Invariants:
- nats-server's config file (`config`) names each password by an environment variable (`password_env`), never
  the value; `shinkai up` (or compose, from its ``.env``) sets those variables in nats-server's environment
  only. With them set, the server refuses a connection without a user's password, and a publish or subscribe
  outside the user's permissions.
- A service's own process gets its user name and password in ``SHINKAI_NATS_USER`` and
  ``SHINKAI_NATS_PASSWORD`` and nothing of any other user's; every Shinkai NATS client connects with
  `connect_options()`. Never on a command line.
- Without those variables (a plain `nats-server` in tests) clients connect without credentials.
- A password is a letter and hex digits: nats-server parses a variable's value as a config value, so one that
  starts with ``-`` would be read as a number and the server would refuse its whole config.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services import subjects

USER_ENV = "SHINKAI_NATS_USER"  # a service's own NATS user name
PASSWORD_ENV = "SHINKAI_NATS_PASSWORD"  # ... and its password
_SERVER_PASSWORD_PREFIX = "SHINKAI_NATS_PASSWORD_"  # + the user's name, upper case: nats-server's variables
GATEWAY, EPLB, OBSERVER = "gateway", "eplb", "observer"


@dataclass(frozen=True)
class NatsUser:
    name: str  # the NATS user name (a service's name in the stack)
    publish: tuple[str, ...]  # subjects it may publish on (wildcards allowed); empty: none
    subscribe: tuple[str, ...]  # subjects it may subscribe to; empty: none


def engine_user(replica: str) -> NatsUser:
    return NatsUser(
        replica,
        tuple(subjects.of_replica(family, replica) for family in subjects.REPLICA_FAMILIES),
        (subjects.EXPERT_PLAN,),
    )


def stack_users(replicas: Iterable[str]) -> list[NatsUser]:
    """Every NATS user of a stack whose engines are ``replicas``."""
    return [
        *(engine_user(r) for r in replicas),
        NatsUser(
            GATEWAY,
            (),
            (
                subjects.every_replica(subjects.ENGINE_LOAD),
                subjects.every_replica(subjects.ENGINE_LIFECYCLE),
                subjects.every_replica(subjects.KV_EVENTS),
            ),
        ),
        NatsUser(EPLB, (subjects.EXPERT_PLAN,), (subjects.every_replica(subjects.EXPERT_LOAD),)),
        NatsUser(OBSERVER, (), (">",)),
    ]


def new_password() -> str:
    """256 random bits, as ``p`` and 64 hex digits (a value nats-server's config reads as a string)."""
    return "p" + secrets.token_hex(32)


def password_env(user: str) -> str:
    """The variable that holds ``user``'s password in nats-server's environment."""
    return _SERVER_PASSWORD_PREFIX + re.sub(r"[^A-Z0-9]", "_", user.upper())


def _permission(allowed: tuple[str, ...]) -> str:
    rule = {"allow": list(allowed)} if allowed else {"deny": [">"]}
    return json.dumps(rule)  # JSON is valid nats-server config


def config(users: Iterable[NatsUser]) -> str:
    """nats-server's config: each user, its password by variable, its permissions. Holds no secret."""
    lines = ["authorization {", "  users = ["]
    for u in users:
        lines.append(
            f'    {{user: "{u.name}", password: ${password_env(u.name)}, '
            f"permissions: {{publish: {_permission(u.publish)}, subscribe: {_permission(u.subscribe)}}}}}"
        )
    lines += ["  ]", "}", ""]
    return "\n".join(lines)


def write_config(path: Path, users: Iterable[NatsUser]) -> Path:
    path.write_text(config(users))
    return path


def server_env(passwords: Mapping[str, str]) -> dict[str, str]:
    """nats-server's variables for ``passwords`` (user → password)."""
    return {password_env(user): password for user, password in passwords.items()}


def client_env(user: str, password: str) -> dict[str, str]:
    """One service's variables: its own user and password."""
    return {USER_ENV: user, PASSWORD_ENV: password}


def connect_options() -> dict[str, str]:
    """Keyword arguments for ``nats.connect``: this service's user and password, when it has them."""
    user, password = os.environ.get(USER_ENV), os.environ.get(PASSWORD_ENV)
    return {"user": user, "password": password} if user and password else {}
