"""One stack's secrets and which process gets which: the service credential (services/service_auth.py), one
NATS password per NATS user (services/nats_auth.py) and the user-facing API key.

`shinkai up` makes a `StackCredentials` and gives each process `env_for(its name)` on top of `without_secrets`
(its own environment with every Shinkai secret taken out), so:
- nats-server gets every NATS user's password (it checks them) and nothing else;
- each Shinkai service gets the service credential, and its own NATS user and password if it has one;
- only the gateway gets the API key.
The secrets live in memory (`up`'s, and the supervisor's, which gets each service's on its stdin to restart
it) and in those environments only: never on a command line, never in stack.json, never on disk.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from services import nats_auth, service_auth
from services.gateway.auth import KEY_ENV

# Every variable that carries a Shinkai secret (names, and prefixes ending in "_").
SECRET_VARIABLES = (KEY_ENV, service_auth.TOKEN_ENV, nats_auth.USER_ENV, nats_auth.PASSWORD_ENV, "SHINKAI_NATS_")
NATS = "nats"  # the NATS server's service name
GATEWAY = "gateway"  # the only service that gets the API key


def is_secret(variable: str) -> bool:
    return any(variable == s or (s.endswith("_") and variable.startswith(s)) for s in SECRET_VARIABLES)


def without_secrets(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with every Shinkai secret variable removed."""
    return {k: v for k, v in env.items() if not is_secret(k)}


class StackCredentials:
    def __init__(self, replicas: Iterable[str], api_key: str | None = None) -> None:
        """Fresh secrets for a stack whose engines are ``replicas``; ``api_key``: the gateway's (None: open)."""
        self.service_token = service_auth.new_token()  # every internal gRPC call carries it
        self.nats_users = nats_auth.stack_users(replicas)  # with their subject permissions
        self.nats_passwords = {u.name: nats_auth.new_password() for u in self.nats_users}  # user → password
        self.api_key = api_key  # comma-separated keys, as SHINKAI_API_KEY takes them; None: the gateway is open

    def env_for(self, service: str) -> dict[str, str]:
        """The secret variables process ``service`` gets, and no others."""
        if service == NATS:
            return nats_auth.server_env(self.nats_passwords)
        env = {service_auth.TOKEN_ENV: self.service_token}
        if service in self.nats_passwords:
            env.update(nats_auth.client_env(service, self.nats_passwords[service]))
        if service == GATEWAY and self.api_key:
            env[KEY_ENV] = self.api_key
        return env

    def nats_observer(self) -> dict[str, str]:
        """``nats.connect`` keyword arguments of the observer user (subscribes to everything, publishes nothing)."""
        return {"user": nats_auth.OBSERVER, "password": self.nats_passwords[nats_auth.OBSERVER]}
