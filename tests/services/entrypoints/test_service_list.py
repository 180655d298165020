"""The one service list: which flags reach which processes, and where each process reaches the others."""


def test_speculative_flags_reach_the_engines_only():
    from services.entrypoints.service_list import services
    from services.entrypoints.stack_config import StackConfig

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
    from services.entrypoints.service_list import services
    from services.entrypoints.stack_config import StackConfig

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


def test_engram_on_host_reaches_every_engine_and_worker_process_and_serve_ranks():
    import argparse

    from services.entrypoints.serve import _config, _rank_argv, register
    from services.entrypoints.service_list import services
    from services.entrypoints.stack_config import StackConfig

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
