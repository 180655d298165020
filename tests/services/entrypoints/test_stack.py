"""The launcher's failure message: a service that dies while `up` waits for it is reported with its log's
last error line, so a bad checkpoint or flag reads in the terminal, not only in the log."""

from services.entrypoints.stack import _last_error


def test_the_last_error_line_of_a_log_ends_the_message(tmp_path):
    log = tmp_path / "engine-0.log"
    log.write_text(
        "INFO starting\nTraceback (most recent call last):\n  File x\n"
        "model.deepseek_v41.safetensors_io.CheckpointError: /m/model-00002.safetensors: truncated\n"
        "INFO bye\n"
    )
    assert (
        _last_error(log) == ": model.deepseek_v41.safetensors_io.CheckpointError: /m/model-00002.safetensors: truncated"
    )
    log.write_text("INFO all fine\n")
    assert _last_error(log) == ""
    assert _last_error(tmp_path / "absent.log") == ""


def test_a_data_parallel_group_is_one_batch_of_rank_engines_meeting_at_one_rendezvous():
    import pytest

    from services.entrypoints.engine import main as engine_main
    from services.entrypoints.service_list import services
    from services.entrypoints.stack import _batches
    from services.entrypoints.stack_config import StackConfig
    from services.entrypoints.worker import main as worker_main

    stack = services(StackConfig(model="tiny", data_parallel_size=3, num_redundant_experts=2, batch_invariant=True))
    assert [s.name for s in stack] == [
        "nats",
        "tokenizer",
        "multimodal",
        "eplb",
        "engine-0",
        "engine-1",
        "engine-2",
        "gateway",
    ]
    ranks = [s for s in stack if s.group == "ranks"]
    assert [s.name for s in ranks] == ["engine-0", "engine-1", "engine-2"]
    rendezvous = {s.argv[s.argv.index("--dp-rendezvous") + 1] for s in ranks}
    assert len(rendezvous) == 1 and rendezvous.pop().startswith("tcp://127.0.0.1:")
    for r, s in enumerate(ranks):
        argv = s.argv
        assert argv[argv.index("--dp-rank") + 1] == str(r) and argv[argv.index("--dp") + 1] == "3"
        assert argv[argv.index("--num-redundant-experts") + 1] == "2"
        assert "--multimodal" in argv and "--batch-invariant" in argv  # each rank's images: the tower's process
    gateway = stack[-1].argv
    assert [gateway[i + 1].split("=")[0] for i, a in enumerate(gateway) if a == "--engine"] == [s.name for s in ranks]
    eplb = stack[3].argv
    assert eplb[eplb.index("--num-ranks") + 1] == "3"
    # The planner plans for the group it serves: 3 ranks, 8 experts + 2 copies rounded up to 12 slots.
    assert eplb[eplb.index("--num-gpus") + 1] == "3" and eplb[eplb.index("--num-redundant") + 1] == "2"
    # up starts (and down stops) a group's members together: they wait for each other at the rendezvous.
    assert [[s.name for s in batch] for batch in _batches(stack)][4:] == [
        ["engine-0", "engine-1", "engine-2"],
        ["gateway"],
    ]
    assert all(s.group is None for s in services(StackConfig(model="tiny", num_engines=2)))
    with pytest.raises(ValueError, match="--num-engines at 1"):
        services(StackConfig(model="tiny", num_engines=2, data_parallel_size=2))
    # With worker processes: the workers start together first and meet at their own rendezvous (the token
    # exchange); each engine drives its worker and the engines meet at theirs (the votes).
    remote = services(StackConfig(model="tiny", remote_workers=True, data_parallel_size=2, batch_invariant=True))
    assert [[s.name for s in batch] for batch in _batches(remote)][4:] == [
        ["worker-0", "worker-1"],
        ["engine-0", "engine-1"],
        ["gateway"],
    ]
    by_name = {s.name: s.argv for s in remote}
    meets = {
        name: argv[argv.index("--dp-rendezvous") + 1] for name, argv in by_name.items() if "--dp-rendezvous" in argv
    }
    assert meets["worker-0"] == meets["worker-1"] != meets["engine-0"] == meets["engine-1"]
    for r in range(2):
        worker, engine = by_name[f"worker-{r}"], by_name[f"engine-{r}"]
        assert worker[worker.index("--dp-rank") + 1] == engine[engine.index("--dp-rank") + 1] == str(r)
        assert engine[engine.index("--worker") + 1].endswith(worker[worker.index("--grpc-addr") + 1].split(":")[1])
    with pytest.raises(ValueError, match="a tcp://host:port rendezvous"):  # refused before any group is joined
        engine_main(["--dp", "2", "--worker", "127.0.0.1:1", "--dp-rendezvous", "nowhere"])
    with pytest.raises(SystemExit, match="needs --dp-rendezvous tcp://host:port"):  # before the model is loaded
        worker_main(["--dp", "2", "--dp-rendezvous", "nowhere"])


def test_up_prints_a_starting_engines_line_when_its_phase_or_count_changes():
    from services.entrypoints.stack import StartupLines
    from services.worker.startup import StartupState

    lines: list[str] = []
    shown = StartupLines("engine-0", lines.append, every_s=3600)
    moved = [
        shown.show(state)  # True: a step, which gives the engine `--timeout` again
        for state in (
            StartupState("loading", 0, None, None, 1.0, 1.0),
            StartupState("loading", 0, None, None, 2.0, 2.0),  # the same phase a probe later: no line
            StartupState("capturing", 0, 4, None, 0.0, 30.0),
            StartupState("capturing", 1, 4, "16 rows", 2.0, 32.0),
            StartupState("capturing", 1, 4, "16 rows", 3.0, 33.0),
        )
    ]
    assert moved == [True, False, True, True, False]
    assert lines == [
        "engine-0   loading 1 s  (1 s since start)",
        f"engine-0   capturing [{'-' * 20}] 0/4 0 s  (30 s since start)",
        f"engine-0   capturing [{'#' * 5}{'-' * 15}] 1/4 (16 rows) 2 s  (32 s since start)",
    ]


# A stand-in service: records when it started, then (once the port it waits for, if any, accepts) after ``delay``
# seconds accepts TCP on its port (its health).
_FAKE = """
import socket, sys, time
name, port, delay, run_dir = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
open(f"{run_dir}/{name}.started", "w").write(repr(time.monotonic()))
while len(sys.argv) > 5:
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[5])), timeout=1).close()
        break
    except OSError:
        time.sleep(0.02)
time.sleep(delay)
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", port))
s.listen()
open(f"{run_dir}/{name}.healthy", "w").write(repr(time.monotonic()))
time.sleep(60)
"""


def test_up_starts_each_service_once_what_it_needs_is_healthy_and_the_rest_at_once(tmp_path, monkeypatch):
    import sys

    from services.entrypoints import stack as stack_module
    from services.entrypoints.service_list import Service
    from services.entrypoints.stack import down, up
    from services.entrypoints.stack_config import StackConfig
    from services.ports import free_port

    def fake(name: str, delay: float, after: tuple[str, ...] = (), waits: Service | None = None) -> Service:
        port = free_port("127.0.0.1")
        argv = [sys.executable, "-c", _FAKE, name, str(port), str(delay), str(tmp_path)]
        argv += [waits.health.split(":")[1]] if waits is not None else []
        return Service(name, argv, f"tcp:{port}", after=after, waits_for=(waits.name,) if waits else ())

    # "slow" needs nothing and takes longest; "first" needs nothing; "second" needs "first"; "last" needs both;
    # "waiter" starts at once but waits for "slow" by itself, longer than --timeout from its own start.
    slow = fake("slow", 1.2)
    fakes = [
        slow,
        fake("first", 0.3),
        fake("second", 0.0, after=("first",)),
        fake("last", 0.0, after=("slow", "second")),
        fake("waiter", 1.0, waits=slow),
    ]
    monkeypatch.setattr(stack_module, "services", lambda config: fakes)
    lines: list[str] = []
    try:
        state = up(StackConfig(run_dir=tmp_path, supervise=False), timeout_s=1.8, log=lines.append)
    finally:
        down(tmp_path, log=lambda *_: None)
    started = {f.name: float((tmp_path / f"{f.name}.started").read_text()) for f in fakes}
    healthy = {f.name: float((tmp_path / f"{f.name}.healthy").read_text()) for f in fakes}
    assert started["first"] < healthy["slow"] and started["slow"] < healthy["first"]  # side by side
    assert started["second"] > healthy["first"] and started["second"] < healthy["slow"]  # not behind "slow"
    assert started["last"] > max(healthy["slow"], healthy["second"])
    assert started["waiter"] < healthy["first"] and healthy["waiter"] > healthy["slow"]  # its clock: from "slow" on
    # stack.json lists them in start order (`down` stops them in reverse); one line per service as it gets healthy.
    assert [s["name"] for s in state["services"]] == ["slow", "first", "waiter", "second", "last"]
    assert [line.split()[0] for line in lines] == ["first", "second", "slow", "last", "waiter"]
    assert all(" healthy in " in line for line in lines)


def test_up_refuses_a_service_that_waits_for_one_not_in_the_stack(tmp_path, monkeypatch):
    import sys

    import pytest

    from services.entrypoints import stack as stack_module
    from services.entrypoints.service_list import Service
    from services.entrypoints.stack import up
    from services.entrypoints.stack_config import StackConfig

    orphan = Service("orphan", [sys.executable, "-c", "pass"], "tcp:1", after=("nowhere",))
    monkeypatch.setattr(stack_module, "services", lambda config: [orphan])
    with pytest.raises(RuntimeError, match="orphan wait for services not in the stack"):
        up(StackConfig(run_dir=tmp_path, supervise=False), timeout_s=5, log=lambda *_: None)


def test_every_service_waits_only_for_services_of_the_stack_and_the_gateway_for_its_engines():
    from services.entrypoints.service_list import services
    from services.entrypoints.stack_config import StackConfig

    for config in (
        StackConfig(model="tiny"),
        StackConfig(model="tiny", num_engines=2, remote_workers=True),
        StackConfig(model="tiny", data_parallel_size=2, remote_workers=True, batch_invariant=True),
    ):
        stack = {s.name: s for s in services(config)}
        assert all(set(s.after) <= set(stack) - {s.name} for s in stack.values())
        engines = {name for name in stack if name.startswith("engine-")}
        # The gateway starts beside the engines and waits for them (and the tokenizer) by itself.
        assert stack["gateway"].after == ("nats",) and {"tokenizer", *engines} == set(stack["gateway"].waits_for)
        assert all(set(s.waits_for) <= set(stack) - {s.name} for s in stack.values())
        assert stack["tokenizer"].after == () and stack.get("multimodal", stack["tokenizer"]).after == ()
        for name in engines:
            worker = name.replace("engine", "worker")
            assert set(stack[name].after) == {"nats", *([worker] if worker in stack else [])}


def test_services_start_without_secrets_and_with_grpc_core_logging_errors_unless_told():
    from services.entrypoints.stack import stack_environment
    from services.service_auth import TOKEN_ENV

    env = stack_environment({"PATH": "/bin", TOKEN_ENV: "secret"})
    assert env["PATH"] == "/bin" and TOKEN_ENV not in env
    # gRPC's core writes its info lines (a peer's GOAWAY) into the service's log unless told otherwise.
    assert env["GRPC_VERBOSITY"] == "ERROR"
    assert stack_environment({"GRPC_VERBOSITY": "INFO"})["GRPC_VERBOSITY"] == "INFO"
