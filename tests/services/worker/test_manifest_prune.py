"""services/worker/manifest_prune.py: on a variants directory holding manifests of the current versions and of
others, with and without key files, fresh and old, stale entries and writers' leftovers, prune removes exactly what
it names and keeps the rest; with writers recording into a manifest while it is pruned again and again, no writer
fails and every file left is whole."""

from __future__ import annotations

import json
import os
import threading
import time

from kernels import rmsnorm
from services.worker.compile_manifest import CompileManifest
from services.worker.manifest_key import KEY_FILE, describe_key, versions
from services.worker.manifest_prune import GRACE_S, prune

NOW = time.time()
DAY = 86400.0
DATA = json.dumps({"signature": {name: "i32" for name in rmsnorm._rmsnorm_kernel.arg_names}})
"""An entry's specialization_data whose parameters match the kernel's (all ``prune`` reads of it)."""


def _manifest(
    root, name: str, valid: dict | None, age_s: float = 0.0, entries=(("kernels.rmsnorm", "_rmsnorm_kernel"),)
):
    """A manifest of ``valid`` versions (None: no key file) whose files were last written ``age_s`` ago."""
    path = root / name
    path.mkdir(parents=True)
    if valid is not None:
        (path / KEY_FILE).write_text(json.dumps({"picks": {"model": name}, "valid": valid}))
    manifest = CompileManifest(path)
    for i, (module, qualname) in enumerate(entries):
        manifest.add(module, qualname, DATA, f"key{i}")
    _age(path, age_s)
    return path


def _age(path, age_s: float) -> None:
    for p in [*path.iterdir(), path] if path.is_dir() else [path]:
        os.utime(p, (NOW - age_s, NOW - age_s))


def test_prune_removes_what_no_start_can_load_and_what_is_unused_and_keeps_the_rest(tmp_path):
    current = {**versions(), "device": "cuda"}
    used = _manifest(tmp_path, "used", current, entries=[("kernels.rmsnorm", "_rmsnorm_kernel"), ("kernels.gone", "k")])
    (used / "tmp.old").write_text("{")  # a dead writer's entry
    _age(used / "tmp.old", 2 * GRACE_S)
    (used / "tmp.young").write_text("{")  # one being written
    other_gpu = _manifest(tmp_path, "other_gpu", {**versions(), "device": "cuda", "capability": [10, 0]})
    old_triton = _manifest(tmp_path, "old_triton", {**current, "triton": "3.4.0"})
    unknown = _manifest(tmp_path, "unknown", None, age_s=2 * GRACE_S)
    young_unknown = _manifest(tmp_path, "young_unknown", None)  # a key file may be on its way
    idle = _manifest(tmp_path, "idle", current, age_s=10 * DAY)
    (tmp_path / "tmp.building").mkdir()  # a directory a dead writer was building
    _age(tmp_path / "tmp.building", 2 * GRACE_S)

    dry = prune(tmp_path, older_than_s=7 * DAY, dry_run=True, now=NOW)
    assert all(r.path.exists() for r in dry)
    removed = prune(tmp_path, older_than_s=7 * DAY, now=NOW)
    assert removed == dry
    why = {str(r.path.relative_to(tmp_path)): r.why for r in removed}
    assert why.pop("old_triton") == f"built for triton 3.4.0, torch {current['torch']}"
    assert why.pop("unknown") == "no readable key file: its versions are unknown"
    assert why.pop("idle") == "unused for 10.0 days"
    assert why.pop("tmp.building") == why.pop("used/tmp.old") == "a writer's leftover"
    ((entry, reason),) = why.items()
    assert entry.startswith("used/") and reason == "its kernel is gone or its parameters changed"
    assert all(r.num_bytes > 0 for r in removed if r.path.name != "tmp.building")
    for kept in (used, other_gpu, young_unknown, used / "tmp.young"):
        assert kept.exists()
    assert [json.loads(f.read_text())["module"] for f in used.glob("*.json")] == ["kernels.rmsnorm"]
    assert not any(p.exists() for p in (old_triton, unknown, idle))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other_gpu", "used", "young_unknown"]  # no rename left
    assert prune(tmp_path, now=NOW) == []  # without --older-than nothing more goes


def test_writers_recording_while_prune_removes_their_manifest_never_fail_and_leave_whole_files(tmp_path):
    manifest = CompileManifest(tmp_path / "engine", describe_key({"model": "m"}, "cpu"))
    errors: list[BaseException] = []

    def record(writer: int) -> None:
        try:
            for i in range(150):
                manifest.add("kernels.rmsnorm", "_rmsnorm_kernel", DATA, f"{writer}-{i}")
        except BaseException as e:  # noqa: BLE001 - the test reports whatever a writer met
            errors.append(e)

    writers = [threading.Thread(target=record, args=(w,)) for w in range(2)]
    for w in writers:
        w.start()
    num_pruned = 0
    while any(w.is_alive() for w in writers):  # every manifest counts as unused: each pass removes it
        num_pruned += sum(r.path.name == "engine" for r in prune(tmp_path, older_than_s=-1.0))
        time.sleep(0.01)
    for w in writers:
        w.join()
    assert errors == [] and num_pruned > 0
    for path in tmp_path.rglob("*"):  # what is left: the manifest made again, whole, its key file first
        assert path.parent == tmp_path / "engine" or path == tmp_path / "engine", path
        if path.is_file():
            text = path.read_text()
            assert (text == manifest.described) if path.name == KEY_FILE else json.loads(text)["module"]
    manifest.add("kernels.rmsnorm", "_rmsnorm_kernel", DATA, "last")  # the manifest made again where pruned last
    assert (tmp_path / "engine" / KEY_FILE).read_text() == manifest.described
