"""The committed generated code is exactly what grpcio-tools makes from the committed .proto files."""

from pathlib import Path

from services.proto import generate


def test_every_proto_has_committed_code():
    protos = generate.proto_files()
    assert {p.parts[2] for p in protos} == {"multimodal", "shinkai", "tokenizer", "worker"}
    for proto in protos:
        for path in generate.generated_files(proto):
            assert (generate.ROOT / path).is_file(), f"{path} is not generated: run python -m services.proto.generate"


def test_regenerated_code_is_byte_identical(tmp_path: Path):
    written = generate.generate(tmp_path)
    assert written
    for path in written:
        fresh = (tmp_path / path).read_bytes()
        committed = (generate.ROOT / path).read_bytes()
        assert fresh == committed, f"{path} differs from a fresh generation: run python -m services.proto.generate"


def test_errors_are_status_codes_not_fields():
    from services.proto.shinkai.v1 import shinkai_pb2

    # No response message carries an error field: failures are gRPC status codes.
    for name in ("GenerateResponse", "Chunk", "Final", "AbortResponse", "ModelInfo", "Loads"):
        fields = getattr(shinkai_pb2, name).DESCRIPTOR.fields_by_name
        assert not any("error" in f for f in fields), name


def test_finish_reasons_match_the_scheduler():
    from scheduler_rs import FinishReason
    from services.engine.finish_reason import FinishReason as EngineFinishReason
    from services.proto.shinkai.v1 import shinkai_pb2

    names = ("STOP", "LENGTH", "ABORT", "PREEMPTED", "ERROR")
    assert [r.name for r in EngineFinishReason] == list(names)
    for name in names:
        rust = getattr(FinishReason, name)
        assert shinkai_pb2.FinishReason.Value(f"FINISH_REASON_{name}") == int(rust) + 1, name
        assert rust.value == name.lower()
        assert EngineFinishReason.of(rust) is EngineFinishReason[name] == rust.value  # a str: JSON stays the same
