"""Reading recorded expert loads and layouts from files, with errors that say what is wrong and where.

A load file holds one layer's ``steps × logical experts`` token counts:
- ``.npy``: a 2-D numeric array;
- ``.json``: a list of rows, or an object whose ``"load"`` key holds them;
- ``.csv``: one row per step, comma-separated; a first line that is not numeric is taken as a header.
"""

from __future__ import annotations

import csv
import json
import pathlib

import numpy as np

from services.eplb.layout import Layout, LayoutError

LOAD_SUFFIXES = (".json", ".npy", ".csv")


class LoadFileError(ValueError):
    """A load or layout file that cannot be read or has the wrong shape or values."""


def _rows_from_json(path: pathlib.Path) -> object:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise LoadFileError(f"{path}: not valid JSON ({err})") from None
    if isinstance(data, dict):
        if "load" not in data:
            raise LoadFileError(f"{path}: a JSON object needs a 'load' key holding steps × experts rows")
        data = data["load"]
    if not isinstance(data, list) or not all(isinstance(row, list) for row in data):
        raise LoadFileError(f"{path}: expected steps × experts (2-D): a list of rows of numbers")
    for step, row in enumerate(data):
        for expert, value in enumerate(row):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise LoadFileError(f"{path}: step {step}, expert {expert}: {value!r} is not a number")
    return data


def _rows_from_csv(path: pathlib.Path) -> list[list[float]]:
    rows: list[list[float]] = []
    with path.open(newline="") as handle:
        for line_no, row in enumerate(csv.reader(handle), start=1):
            if not row or all(not cell.strip() for cell in row):
                continue
            try:
                rows.append([float(cell) for cell in row])
            except ValueError:
                if line_no == 1:
                    continue  # header
                raise LoadFileError(f"{path}:{line_no}: non-numeric value in {row[:6]}") from None
    return rows


def read_load(path: str | pathlib.Path) -> np.ndarray:
    """A ``steps × experts`` float64 array of non-negative, finite token counts."""
    path = pathlib.Path(path)
    if path.suffix not in LOAD_SUFFIXES:
        raise LoadFileError(f"{path}: unknown load format {path.suffix!r}; use one of {', '.join(LOAD_SUFFIXES)}")
    if not path.is_file():
        raise LoadFileError(f"{path}: no such file")
    if path.suffix == ".npy":
        try:
            array = np.load(path, allow_pickle=False)
        except (ValueError, OSError) as err:
            raise LoadFileError(f"{path}: not a readable .npy array ({err})") from None
        if array.dtype.kind not in "iuf":
            raise LoadFileError(f"{path}: token counts must be numbers, got dtype {array.dtype}")
        data: object = array
    elif path.suffix == ".json":
        data = _rows_from_json(path)
    else:
        data = _rows_from_csv(path)
    try:
        load = np.asarray(data, dtype=np.float64)
    except OverflowError:
        raise LoadFileError(f"{path}: a token count is too large for float64") from None
    except (TypeError, ValueError):
        raise LoadFileError(f"{path}: rows must all be numbers of one length (steps × experts)") from None
    return check_load_array(load, str(path))


def check_load_array(load: np.ndarray, source: str) -> np.ndarray:
    if load.ndim != 2:
        raise LoadFileError(f"{source}: expected steps × experts (2-D), got shape {load.shape}")
    if load.shape[0] < 1 or load.shape[1] < 1:
        raise LoadFileError(f"{source}: needs at least one step and one expert, got shape {load.shape}")
    if not np.isfinite(load).all():
        raise LoadFileError(f"{source}: contains NaN or infinite values")
    if (load < 0).any():
        step, expert = np.argwhere(load < 0)[0]
        raise LoadFileError(f"{source}: negative token count at step {step}, expert {expert}")
    with np.errstate(over="ignore"):
        overflow = not np.isfinite(load.sum())
    if overflow:
        raise LoadFileError(f"{source}: token counts too large: their sum overflows float64")
    return load


def read_layout(path: str | pathlib.Path, num_logical: int, num_gpus: int) -> Layout:
    """A layout (or a plan holding one) that must match the load's experts and the GPU count."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise LoadFileError(f"{path}: no such file")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise LoadFileError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise LoadFileError(f"{path}: a layout is a JSON object with 'phy2log' and 'num_gpus'")
    try:
        layout = Layout.from_dict(data, num_logical)
    except LayoutError as err:
        raise LoadFileError(f"{path}: {err}") from None
    if layout.num_gpus != num_gpus:
        raise LoadFileError(f"{path}: layout is for {layout.num_gpus} GPUs, but --num-gpus is {num_gpus}")
    if layout.num_logical != num_logical:
        raise LoadFileError(f"{path}: layout has {layout.num_logical} experts, the load has {num_logical}")
    return layout
