"""NATS with per-service users (services/nats_auth.py) on a real nats-server started as `shinkai up` starts it:
a connection without a user's password is refused; an engine's credential publishes its own subjects only,
the gateway's none, so neither can forge another engine's lifecycle events; and the gateway's router believes
a message only from the subject of the engine it names."""

import asyncio
import json
import re
import subprocess

import nats
import pytest

from services import nats_auth, subjects
from services.entrypoints.credentials import StackCredentials
from services.entrypoints.placement import LocalPlacement, nats_server_binary
from services.entrypoints.service_list import services
from services.entrypoints.stack_config import StackConfig
from services.gateway.remote import RemoteEngine
from services.gateway.router import EngineRouter
from tests.nats_server import wait_for

pytestmark = pytest.mark.timeout(60)
REPLICAS = ("engine-0", "engine-1")
LIFECYCLE_0 = subjects.of_replica(subjects.ENGINE_LIFECYCLE, "engine-0")
LIFECYCLE_1 = subjects.of_replica(subjects.ENGINE_LIFECYCLE, "engine-1")


def down_message(replica: str) -> bytes:
    return json.dumps({"replica": replica, "state": "down"}).encode()


@pytest.fixture
def authed_nats(tmp_path, monkeypatch):
    """nats-server with the stack's config file and every user's password in its environment only; yields the
    URL and the stack's credentials. This process connects as the gateway, as `up` sets the gateway up."""
    credentials = StackCredentials(REPLICAS)
    for key, value in nats_auth.client_env("gateway", credentials.nats_passwords["gateway"]).items():
        monkeypatch.setenv(key, value)
    log = tmp_path / "nats.log"
    conf = nats_auth.write_config(tmp_path / "nats.conf", credentials.nats_users)
    proc = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", "-1", "-l", str(log), "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=credentials.env_for("nats"),
    )
    try:
        text = wait_for(
            lambda: log.exists() and "Server is ready" in log.read_text() and log.read_text(),
            20,
            "nats-server to start",
        )
        port = re.search(r"Listening for client connections on 127\.0\.0\.1:(\d+)", text).group(1)
        yield f"nats://127.0.0.1:{port}", credentials
    finally:
        proc.terminate()
        proc.wait(10)


async def until(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def connect_as(url: str, credentials: StackCredentials, user: str, errors: list[str]):
    async def on_error(err: Exception) -> None:
        errors.append(str(err))

    return await nats.connect(
        url, user=user, password=credentials.nats_passwords[user], error_cb=on_error, allow_reconnect=False
    )


def test_a_connection_without_a_users_password_is_refused(authed_nats):
    url, credentials = authed_nats

    async def run():
        for creds in (
            {},
            {"token": "guess"},
            {"user": "engine-0", "password": "guess"},
            {"user": "engine-0", "password": credentials.nats_passwords["engine-1"]},  # another user's
            {"user": "shinkai", "password": credentials.service_token},
        ):
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(url, connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0, **creds)

    asyncio.run(run())


def test_no_credential_can_publish_another_engines_lifecycle(authed_nats):
    url, credentials = authed_nats

    async def run():
        router = EngineRouter([RemoteEngine(r, f"127.0.0.1:{i + 1}") for i, r in enumerate(REPLICAS)])
        await router.subscribe(url)  # as the gateway, with its user from the environment
        observer = await nats.connect(url, **credentials.nats_observer())
        seen: list[str] = []

        async def on_message(msg) -> None:
            seen.append(msg.subject)

        await observer.subscribe(subjects.every_replica(subjects.ENGINE_LIFECYCLE), cb=on_message)
        await observer.flush()
        try:
            for user in ("engine-1", "gateway", "eplb", "observer"):
                errors: list[str] = []
                nc = await connect_as(url, credentials, user, errors)
                await nc.publish(LIFECYCLE_0, down_message("engine-0"))
                await nc.flush()
                await until(lambda: errors)  # the server says so, and drops the message
                assert "permissions violation for publish" in errors[0].lower(), (user, errors)
                assert LIFECYCLE_0 in errors[0], (user, errors)
                await nc.close()
            # engine-1 on its own subject, naming engine-0: delivered, but the router believes the subject.
            errors = []
            engine1 = await connect_as(url, credentials, "engine-1", errors)
            await engine1.publish(LIFECYCLE_1, down_message("engine-0"))
            await engine1.flush()
            await until(lambda: LIFECYCLE_1 in seen)
            await asyncio.sleep(0.2)
            assert seen == [LIFECYCLE_1] and not errors
            assert router.states["engine-0"].accepting and router.states["engine-1"].accepting
            # engine-0 about itself: the message that works, so the refusals above are the permissions'.
            engine0 = await connect_as(url, credentials, "engine-0", errors)
            await engine0.publish(LIFECYCLE_0, down_message("engine-0"))
            await engine0.flush()
            await until(lambda: not router.states["engine-0"].accepting)
            assert router.states["engine-1"].accepting and not errors
            for nc in (engine0, engine1):
                await nc.close()
        finally:
            await observer.close()
            await router.close()

    asyncio.run(run())


def test_a_gateway_credential_cannot_subscribe_to_the_planners_subjects(authed_nats):
    url, credentials = authed_nats

    async def run():
        errors: list[str] = []
        nc = await connect_as(url, credentials, "gateway", errors)
        await nc.subscribe(subjects.every_replica(subjects.EXPERT_LOAD))
        await nc.flush()
        await until(lambda: errors)
        assert "permissions violation for subscription" in errors[0].lower(), errors
        await nc.close()

    asyncio.run(run())


def test_no_password_travels_on_a_command_line_or_in_the_config(authed_nats):
    _, credentials = authed_nats
    argvs = [" ".join(s.argv) for s in services(StackConfig(http_port=0, grpc_port=0), LocalPlacement("127.0.0.1"))]
    config = nats_auth.config(credentials.nats_users)
    for password in credentials.nats_passwords.values():
        assert not any(password in a for a in argvs) and password not in config
    assert all("$" + nats_auth.password_env(u.name) in config for u in credentials.nats_users)


def test_every_password_is_a_string_to_nats_server(tmp_path):
    """The server reads a variable's value as a config value: one that starts with ``-`` is parsed as a
    number and the whole config is refused. Passwords start with a letter and hold only hex digits after it."""
    users = nats_auth.stack_users(["engine-0"])
    conf = nats_auth.write_config(tmp_path / "nats.conf", users)

    def valid(password: str) -> bool:
        env = nats_auth.server_env({u.name: password for u in users})
        done = subprocess.run([nats_server_binary(), "-c", str(conf), "-t"], capture_output=True, timeout=30, env=env)
        return done.returncode == 0

    assert not valid("-r" + "a" * 40)  # what token_urlsafe can give
    passwords = [nats_auth.new_password() for _ in range(1000)]
    assert all(re.fullmatch(r"p[0-9a-f]{64}", p) for p in passwords) and len(set(passwords)) == 1000
    assert all(valid(p) for p in passwords[:3])


def test_replica_names_must_be_one_subject_token():
    assert subjects.of_replica(subjects.ENGINE_LOAD, "engine-7") == "shinkai.engine.load.engine-7"
    assert subjects.replica_of(subjects.ENGINE_LOAD, "shinkai.engine.load.engine-7") == "engine-7"
    assert subjects.replica_of(subjects.ENGINE_LOAD, "shinkai.engine.lifecycle.engine-7") is None
    for bad in ("", "a.b", "a*", ">", "a b"):
        with pytest.raises(ValueError, match="one NATS subject token"):
            subjects.of_replica(subjects.ENGINE_LOAD, bad)
