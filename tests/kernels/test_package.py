import importlib.metadata
import pathlib

import kernels

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_kernels_resolves_to_ours():
    assert getattr(kernels, "SHINKAI_KERNELS", False)
    assert pathlib.Path(kernels.__file__).resolve().parent == ROOT / "kernels"


def test_hugging_face_kernels_is_not_installed():
    try:
        dist = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise AssertionError(f"Hugging Face's `kernels` {dist.version} shadows ours; uninstall it")
