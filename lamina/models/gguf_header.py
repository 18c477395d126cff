"""A fast, read-only look at a GGUF file's header: its metadata and whether the tensor data is all there.

The full reader (gguf.GGUFReader) builds numpy views of every tensor and takes seconds on a large file; this
walks only the header (metadata and tensor infos), so a truncated or corrupt file is reported at once, by
name, before anything is loaded, and small metadata (architecture, sampling defaults) is read cheaply.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF value types -> struct format of a scalar (8: string and 9: array are handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
# Arrays longer than this are skipped, not kept (the tokenizer's vocabulary and merges).
_MAX_KEPT_ARRAY = 64


class GGUFError(ValueError):
    """The file is not a readable GGUF file; the message names it and says what is wrong."""


@dataclass
class GGUFHeader:
    version: int
    metadata: dict[str, Any] = field(default_factory=dict)  # scalars, strings and short arrays
    num_tensors: int = 0
    data_end: int = 0  # bytes the file must have to hold every tensor


class _Cursor:
    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: the GGUF file is truncated (its header ends early)")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: the GGUF file is truncated (its header ends early)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("<I"), self.take("<Q")
            if itype in _SCALARS and count > _MAX_KEPT_ARRAY:  # skip numeric arrays without reading them
                self.pos += struct.calcsize(_SCALARS[itype]) * count
                if self.pos > len(self.buf):
                    raise GGUFError(f"{self.path}: the GGUF file is truncated (its header ends early)")
                return None
            items = [self.value(itype) for _ in range(count)]
            return items if count <= _MAX_KEPT_ARRAY else None
        raise GGUFError(f"{self.path}: corrupt GGUF file (unknown metadata value type {vtype})")


def _tensor_bytes(ggml_type: int, dims: list[int], path: Path) -> int:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: corrupt GGUF file (unknown tensor type {ggml_type})") from None
    numel = 1
    for d in dims:
        numel *= d
    return numel // block * type_size


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Reads the header of a GGUF file; raises GGUFError (naming the file) if it is not GGUF, is corrupt, or
    is shorter than its tensors need."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = path.stat().st_size
            if size < 24:
                raise GGUFError(f"{path}: not a GGUF file (only {size} bytes)")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse(_Cursor(buf, path), size)
    except OSError as e:
        raise GGUFError(f"{path}: cannot read the file ({e.strerror or e})") from None


def _parse(cur: _Cursor, size: int) -> GGUFHeader:
    path = cur.path
    if bytes(cur.buf[:4]) != _MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (it does not start with 'GGUF')")
    cur.pos = 4
    version = cur.take("<I")
    if version not in (2, 3):
        raise GGUFError(f"{path}: corrupt GGUF file, or an unsupported version ({version}; lamina reads 2 and 3)")
    num_tensors, num_kv = cur.take("<Q"), cur.take("<Q")
    if num_kv > size or num_tensors > size:
        raise GGUFError(f"{path}: corrupt GGUF file (implausible counts in its header)")
    header = GGUFHeader(version, num_tensors=num_tensors)
    for _ in range(num_kv):
        key = cur.string()
        header.metadata[key] = cur.value(cur.take("<I"))
    data_rel_end = 0
    for _ in range(num_tensors):
        cur.string()  # name
        n_dims = cur.take("<I")
        if n_dims > 8:
            raise GGUFError(f"{path}: corrupt GGUF file (a tensor with {n_dims} dimensions)")
        dims = [cur.take("<Q") for _ in range(n_dims)]
        ggml_type, offset = cur.take("<I"), cur.take("<Q")
        data_rel_end = max(data_rel_end, offset + _tensor_bytes(ggml_type, dims, path))
    align = header.metadata.get("general.alignment", _DEFAULT_ALIGNMENT) or _DEFAULT_ALIGNMENT
    data_start = (cur.pos + align - 1) // align * align
    header.data_end = data_start + data_rel_end
    if size < header.data_end:
        raise GGUFError(f"{path}: the GGUF file is truncated ({size} bytes; its tensors need {header.data_end})")
    return header
