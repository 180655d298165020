"""The launcher's failure message: a service that dies while `up` waits for it is reported with its log's
last error line, so a bad checkpoint or flag reads in the terminal, not only in the log."""

from services.stack import _last_error


def test_the_last_error_line_of_a_log_ends_the_message(tmp_path):
    log = tmp_path / "engine-0.log"
    log.write_text("INFO starting\nTraceback (most recent call last):\n  File x\n"
                   "model.deepseek_v41.safetensors_io.CheckpointError: /m/model-00002.safetensors: truncated\n"
                   "INFO bye\n")
    assert _last_error(log) == ": model.deepseek_v41.safetensors_io.CheckpointError: /m/model-00002.safetensors: truncated"
    log.write_text("INFO all fine\n")
    assert _last_error(log) == ""
    assert _last_error(tmp_path / "absent.log") == ""


def test_speculative_flags_reach_the_engines_only():
    from services.stack import StackConfig, services

    stack = services(StackConfig(model="tiny", num_engines=2, num_speculative_tokens=4, spec_sampling="deterministic",
                                 spec_varlen=True, remote_workers=True))
    engines = [s for s in stack if s.name.startswith("engine-")]
    assert len(engines) == 2
    for engine in engines:
        i = engine.argv.index("--num-speculative-tokens")
        assert engine.argv[i + 1 : i + 5] == ["4", "--spec-sampling", "deterministic", "--spec-varlen"]
    assert all("--spec-varlen" not in s.argv for s in stack if not s.name.startswith("engine-"))
    assert all("--num-speculative-tokens" not in s.argv for s in stack if not s.name.startswith("engine-"))
    assert all("--num-speculative-tokens" not in s.argv for s in services(StackConfig(model="tiny")))


def test_engines_reach_the_multimodal_service_and_the_ssrf_flag_reaches_the_gateway():
    from services.stack import StackConfig, services

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
    assert "--worker" in argv and argv[argv.index("--multimodal") + 1] == \
        f"127.0.0.1:{remote['multimodal'].health.split(':')[1]}"
    assert "--multimodal" not in remote["worker-0"].argv
