"""GPU memory estimate of a model path on disk (FEATURES B8): the file-reading half.

The math lives in :mod:`heteroflow.core.estimate`; this module finds its inputs:

* a ``.gguf`` file: metadata from its header (:func:`read_gguf_meta`), weights = the file
  size, or for a split model (``NAME-00001-of-0000N.gguf``, any shard given) the sum of
  all N shards' sizes with the metadata of the first;
* a directory with ``config.json`` and weight files: the Hugging Face estimate with
  ``weights_bytes`` = the total size of the weight files (see :func:`weight_files`);
* a directory with ``.gguf`` files: that model, picked as the agent's llama.cpp launcher
  picks it (the first ``-00001-of-`` shard in name order, else the first file; ``mmproj``
  projector files are skipped);
* a directory with only ``config.json``: the estimate from the parameter count.

Anything else, an unreadable file or metadata lacking a needed key gives ``None``: the
create-time precheck is then skipped, so a user's path never makes this raise.
"""

from __future__ import annotations

import json
import logging
import mmap
import re
import stat
import struct
from pathlib import Path
from typing import Any

import gguf

from heteroflow.core.engines.context import EngineContext
from heteroflow.core.estimate import MemoryEstimate, estimate_gguf_meta, estimate_hf

log = logging.getLogger(__name__)

_SHARD = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)
# Numeric arrays up to this length are kept (per-layer values such as head_count_kv);
# vocabulary-sized arrays (token scores, merges) and string arrays are skipped.
_MAX_ARRAY_LEN = 4096
# Weight formats in the order loaders prefer them, with their shard index files. Only the
# first format present counts, so a repository shipping both safetensors and .bin copies
# of the same weights is not counted twice.
_WEIGHT_FORMATS = (
    (".safetensors", "model.safetensors.index.json"),
    (".bin", "pytorch_model.bin.index.json"),
    (".pt", ""),
)
_NOT_WEIGHTS = frozenset({"training_args.bin", "optimizer.pt", "scheduler.pt"})

_T = gguf.GGUFValueType
_SCALAR_FORMATS: dict[int, str] = {
    _T.UINT8: "<B", _T.INT8: "<b", _T.UINT16: "<H", _T.INT16: "<h", _T.UINT32: "<I",
    _T.INT32: "<i", _T.FLOAT32: "<f", _T.BOOL: "<?", _T.UINT64: "<Q", _T.INT64: "<q",
    _T.FLOAT64: "<d",
}  # fmt: skip


def _string(buf: mmap.mmap, off: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, off)
    end = off + 8 + length
    if end > len(buf):
        raise ValueError("GGUF string runs past the end of the file")
    return buf[off + 8 : end].decode("utf-8", errors="replace"), end


def _value(buf: mmap.mmap, off: int, vtype: int, keep: bool) -> tuple[Any, int]:
    """Decode (or, when not ``keep``, skip) one value; returns it and the next offset."""
    if vtype in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[vtype]
        return (struct.unpack_from(fmt, buf, off)[0] if keep else None), off + struct.calcsize(fmt)
    if vtype == _T.STRING:
        text, end = _string(buf, off)
        return (text if keep else None), end
    if vtype != _T.ARRAY:
        raise ValueError(f"unknown GGUF value type {vtype}")
    item_type, count = struct.unpack_from("<IQ", buf, off)
    off += 12
    if item_type in _SCALAR_FORMATS:
        fmt = _SCALAR_FORMATS[item_type]
        end = off + count * struct.calcsize(fmt)
        if end > len(buf):
            raise ValueError("GGUF array runs past the end of the file")
        if keep and count <= _MAX_ARRAY_LEN:
            return list(struct.unpack_from(f"<{count}{fmt[1]}", buf, off)), end
        return None, end
    if count > (len(buf) - off) // 8:  # each string or array item takes at least 8 bytes
        raise ValueError("GGUF array count exceeds the file")
    for _ in range(count):  # string or nested arrays: walk over them
        _, off = _value(buf, off, item_type, False)
    return None, off


def read_gguf_meta(path: Path) -> dict[str, Any]:
    """The key/values of a GGUF header (v2/v3, little-endian); tensors are not read.

    Scalars and strings come back as Python values, numeric arrays up to 4096 long as
    lists (per-layer values such as ``head_count_kv``); string arrays, nested arrays and
    longer arrays (the vocabulary, merges, scores) are skipped without being decoded, which
    keeps this at milliseconds where :class:`gguf.GGUFReader`, which materialises every
    token string, takes about 10 s for a 150k-token vocabulary. The values equal what
    ``GGUFReader(path).fields[key].contents()`` returns (the tests check this). Raises
    ``ValueError`` or ``OSError`` for a file that is not a readable GGUF.
    """
    return _read_gguf(path, tensors=False)[0]


def _read_gguf(path: Path, *, tensors: bool) -> tuple[dict[str, Any], int]:
    """The header's key/values and, with ``tensors``, the bytes the file must hold: the
    tensor infos walked, the data section aligned, the furthest tensor's end (0 without)."""
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            magic, version, n_tensors, kv_count = struct.unpack_from("<IIQQ", buf, 0)
            if magic != gguf.GGUF_MAGIC or version not in (2, 3):
                raise ValueError(f"{path} is not a little-endian GGUF v2/v3 file")
            meta: dict[str, Any] = {}
            off = 24
            for _ in range(kv_count):
                key, off = _string(buf, off)
                (vtype,) = struct.unpack_from("<I", buf, off)
                value, off = _value(buf, off + 4, vtype, True)
                if value is not None:
                    meta[key] = value
            needed = _tensor_data_end(buf, off, n_tensors, meta) if tensors else 0
        except struct.error as exc:
            raise ValueError(f"{path}: truncated GGUF header ({exc})") from exc
    return meta, needed


def _tensor_data_end(buf: mmap.mmap, off: int, n_tensors: int, meta: dict[str, Any]) -> int:
    """Where the last tensor's data ends: after the tensor infos (name, dims, type,
    offset), the data section starts at the next multiple of ``general.alignment``."""
    if n_tensors > (len(buf) - off) // 24:  # each info takes at least 24 bytes
        raise ValueError("GGUF tensor count exceeds the file")
    furthest = 0
    for _ in range(n_tensors):
        _, off = _string(buf, off)
        (n_dims,) = struct.unpack_from("<I", buf, off)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, off + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, off + 4 + 8 * n_dims)
        off += 4 + 8 * n_dims + 12
        try:
            block, type_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"unknown GGML tensor type {ggml_type}") from None
        elements = 1
        for d in dims:
            elements *= d
        furthest = max(furthest, offset + elements // block * type_bytes)
    align = meta.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    align = align if isinstance(align, int) and align > 0 else gguf.GGUF_DEFAULT_ALIGNMENT
    return -(-off // align) * align + furthest


def gguf_meta_of(path: Path) -> dict[str, Any] | None:
    """The header of the GGUF file at ``path`` (a split model's own shard), or None when
    there is no readable GGUF file here (a folder, a path only the nodes have)."""
    try:
        return read_gguf_meta(path) if path.is_file() and path.suffix == ".gguf" else None
    except (ValueError, OSError):
        return None


def gguf_problem(path: Path) -> str | None:
    """Why the GGUF file at ``path`` cannot be loaded, as far as its header tells (empty,
    not GGUF, a truncated header, or fewer bytes than its tensors need); None when it
    reads, or when there is no regular file here to read (a path only the nodes have).
    A shard's tensors are its own, so each shard is checked alone."""
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    if st.st_size == 0:
        return f"{path} is empty (0 bytes): not a GGUF model"
    try:
        _, needed = _read_gguf(path, tensors=True)
    except (ValueError, OSError) as exc:
        return f"{path} is not a loadable GGUF model: {exc}"
    if needed > st.st_size:  # a copy cut short: the header reads, the weights are missing
        return (
            f"{path} is truncated: its tensors need {needed} bytes, the file holds "
            f"{st.st_size} (an interrupted download or copy?)"
        )
    return None


def gguf_shards(path: Path) -> list[Path]:
    """All files of the GGUF model ``path`` belongs to, the first shard first."""
    match = _SHARD.match(path.name)
    if match is None:
        return [path]
    count = match["count"]
    return [
        path.with_name(f"{match['stem']}-{i:05d}-of-{count}.gguf")
        for i in range(1, int(count) + 1)
    ]


def _gguf_in(directory: Path) -> Path | None:
    ggufs = [
        p for p in sorted(directory.glob("*.gguf"))
        if p.is_file() and not p.name.lower().startswith("mmproj")
    ]
    shards = [p for p in ggufs if "-00001-of-" in p.name]
    return shards[0] if shards else (ggufs[0] if ggufs else None)


def _indexed(directory: Path, index_name: str) -> list[Path] | None:
    """The files a ``*.index.json`` weight map names, or None without a usable index."""
    index = directory / index_name
    if not index_name or not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return files if files and all(f.is_file() for f in files) else None


def weight_files(directory: Path) -> list[Path]:
    """The weight files of a Hugging Face model directory (top level only).

    The first format present of safetensors, ``.bin``, ``.pt`` counts: the files its shard
    index (``model.safetensors.index.json``) names, else every file of that extension,
    skipping ``consolidated*`` copies (Mistral's original format) when HF shards exist and
    training state (``training_args.bin``, ``optimizer.pt``, ``scheduler.pt``).
    """
    for ext, index_name in _WEIGHT_FORMATS:
        indexed = _indexed(directory, index_name)
        if indexed is not None:
            return indexed
        files = [
            p for p in sorted(directory.glob(f"*{ext}"))
            if p.is_file() and p.name not in _NOT_WEIGHTS
        ]
        hf_shards = [p for p in files if not p.name.startswith("consolidated")]
        if files:
            return hf_shards or files
    return []


def _estimate_gguf(
    path: Path, context_tokens: int | None, engine: EngineContext | None
) -> MemoryEstimate:
    shards = gguf_shards(path)
    file_bytes = sum(p.stat().st_size for p in shards)  # a missing shard raises OSError
    meta = read_gguf_meta(shards[0])
    return estimate_gguf_meta(
        meta, file_bytes=file_bytes, context_tokens=context_tokens, engine_context=engine
    )


def _estimate(
    path: Path, context_tokens: int | None, engine: EngineContext | None
) -> MemoryEstimate | None:
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            return None
        return _estimate_gguf(path, context_tokens, engine)
    if not path.is_dir():
        return None
    config_path = path / "config.json"
    files = weight_files(path) if config_path.is_file() else []
    gguf_file = None if files else _gguf_in(path)
    if gguf_file is not None:
        return _estimate_gguf(gguf_file, context_tokens, engine)
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        return None
    weights = sum(p.stat().st_size for p in files) if files else None
    return estimate_hf(
        config, context_tokens=context_tokens, weights_bytes=weights, engine_context=engine
    )


def estimate_model_path(
    path: Path,
    *,
    context_tokens: int | None = None,
    engine_context: EngineContext | None = None,
) -> MemoryEstimate | None:
    """The memory estimate of the model at ``path``, or None when it cannot be made.

    ``engine_context``: the context the engine's arguments set
    (:func:`heteroflow.core.engines.registry.engine_context`), used for the KV cache.
    Never raises for a user-supplied path: missing or unreadable files, a file that is not
    GGUF, invalid JSON or metadata lacking a needed key all give None (precheck skipped).
    """
    try:
        return _estimate(Path(path), context_tokens, engine_context)
    except Exception as exc:  # any failure on a user path means "cannot estimate"
        log.debug("no memory estimate for %s: %s", path, exc)
        return None
