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


def test_speculative_flags_reach_the_engines_only():
    from services.entrypoints.stack import StackConfig, services

    stack = services(
        StackConfig(
            model="tiny",
            num_engines=2,
            num_speculative_tokens=4,
            spec_sampling="deterministic",
            spec_varlen=True,
            remote_workers=True,
        )
    )
    engines = [s for s in stack if s.name.startswith("engine-")]
    assert len(engines) == 2
    for engine in engines:
        i = engine.argv.index("--num-speculative-tokens")
        assert engine.argv[i + 1 : i + 5] == ["4", "--spec-sampling", "deterministic", "--spec-varlen"]
    assert all("--spec-varlen" not in s.argv for s in stack if not s.name.startswith("engine-"))
    assert all("--num-speculative-tokens" not in s.argv for s in stack if not s.name.startswith("engine-"))
    assert all("--num-speculative-tokens" not in s.argv for s in services(StackConfig(model="tiny")))


def test_engines_reach_the_multimodal_service_and_the_ssrf_flag_reaches_the_gateway():
    from services.entrypoints.stack import StackConfig, services

    stack = {s.name: s for s in services(StackConfig(model="tiny", num_engines=2, allow_private_image_urls=True))}
    address = f"127.0.0.1:{stack['multimodal'].health.split(':')[1]}"
    for name in ("engine-0", "engine-1"):
        argv = stack[name].argv
        assert argv[argv.index("--multimodal") + 1] == address
    assert "--allow-private-image-urls" in stack["gateway"].argv
    plain = {s.name: s for s in services(StackConfig(model="tiny"))}
    assert "--allow-private-image-urls" not in plain["gateway"].argv
    # Remote workers too: the engine encodes there, and its worker takes the rows by worker.v1 SetImages.
    remote = {s.name: s for s in services(StackConfig(model="tiny", remote_workers=True))}
    argv = remote["engine-0"].argv
    assert (
        "--worker" in argv
        and argv[argv.index("--multimodal") + 1] == f"127.0.0.1:{remote['multimodal'].health.split(':')[1]}"
    )
    assert "--multimodal" not in remote["worker-0"].argv


def test_a_data_parallel_group_is_one_batch_of_rank_engines_meeting_at_one_rendezvous():
    import pytest

    from services.entrypoints.engine import main as engine_main
    from services.entrypoints.stack import StackConfig, _batches, services
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


def test_engram_on_host_reaches_every_engine_and_worker_process_and_serve_ranks():
    import argparse

    from services.entrypoints.serve import _config, _rank_argv, register
    from services.entrypoints.stack import StackConfig, services

    stack = services(StackConfig(model="tiny", num_engines=2, remote_workers=True, engram_on_host=True))
    processes = [s for s in stack if s.name.startswith(("engine", "worker"))]
    assert len(processes) == 4 and all("--engram-on-host" in s.argv for s in processes)
    assert not any("--engram-on-host" in s.argv for s in services(StackConfig(model="tiny", remote_workers=True)))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--dp", "2", "--engram-on-host"])
    assert "--engram-on-host" in _rank_argv(args)  # each rank process of serve --dp
    args = parser.parse_args(
        ["serve", "--dp", "2", "--num-speculative-tokens", "2", "--spec-sampling", "deterministic", "--spec-varlen"]
    )
    argv = _rank_argv(args)  # speculative decoding runs with ranks
    assert argv[argv.index("--num-speculative-tokens") + 1] == "2" and "--spec-varlen" in argv
    assert argv[argv.index("--spec-sampling") + 1] == "deterministic"
    assert _config(parser.parse_args(["serve", "--engram-on-host"])).engine_args["engram_on_host"] is True


def test_local_ports_are_never_given_twice(monkeypatch):
    """The OS may return the same free port on consecutive calls (it is closed in between): the placement must
    not give it to two services."""
    from services.entrypoints import stack

    offered = iter([5001, 5001, 5001, 5002, 5001, 5003])
    monkeypatch.setattr(stack, "free_port", lambda host: next(offered))
    at = stack.LocalPlacement("127.0.0.1")
    ports = [
        at.port("engine-0", "grpc"),
        at.port("worker-0", "grpc"),
        at.port("engine-0", "grpc"),
        at.port("gateway", "grpc"),
    ]
    assert ports == [5001, 5002, 5001, 5003]
