"""A GGUF file's metadata and tensor table, parsed straight from its memory map.

    magic "GGUF" | version u32 (2 or 3) | tensor count u64 | key-value count u64
    key-values:  key (string), value type u32, value
                 (a string is a u64 length and UTF-8 bytes; an array is its element type
                 u32, a u64 count and the elements)
    tensor table: name (string), dimension count u32, dimensions u64 each (innermost first),
                 ggml type u32, offset u64 (from the aligned start of the data)
    data:        after the table, at `general.alignment` (32 when absent)

The `gguf` package's reader builds a numpy view per field part, ~10^6 of them for a 49k-token
vocabulary (2-3 s of CPU per process that loads SmolLM2, each tensor-parallel worker among
them); this reads the same with `struct` and one `np.frombuffer` per numeric array and per
tensor. The `gguf` package still names the tensor types and dequantizes.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS: dict[int, tuple[str, int]] = {  # value type -> struct format, size
    0: ("<B", 1),  # uint8
    1: ("<b", 1),  # int8
    2: ("<H", 2),  # uint16
    3: ("<h", 2),  # int16
    4: ("<I", 4),  # uint32
    5: ("<i", 4),  # int32
    6: ("<f", 4),  # float32
    7: ("<?", 1),  # bool
    10: ("<Q", 8),  # uint64
    11: ("<q", 8),  # int64
    12: ("<d", 8),  # float64
}
_STRING, _ARRAY = 8, 9
_PLAIN_TYPES = {0: np.float32, 1: np.float16}  # ggml F32, F16: their own element type


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any
    """`gguf.GGMLQuantizationType`."""
    shape: tuple[int, ...]
    """Outermost dimension first (the table stores innermost first)."""
    data: np.ndarray
    """A read-only view of the file: float32/float16 elements for F32/F16, else the raw bytes
    shaped [*shape[:-1], bytes per row], as `gguf.quants.dequantize` takes them."""


class GGUFFile:
    """One GGUF file, memory-mapped: `metadata` (numbers, strings, arrays as lists) and
    `tensors` by name. `ValueError` naming the file for anything malformed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:  # ValueError: an empty file cannot be mapped
            raise self._bad(str(e)) from e
        try:
            self.metadata, self._table, self._data_start = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, KeyError) as e:
            raise self._bad(f"truncated or corrupt: {e}") from e

    def _bad(self, why: str) -> ValueError:
        return ValueError(f"{self.path}: not a readable GGUF file ({why})")

    @cached_property
    def tensors(self) -> dict[str, GGUFTensor]:
        """Every tensor by name (built on first use: the metadata alone needs no `gguf`)."""
        out: dict[str, GGUFTensor] = {}
        for name, dims, kind, offset in self._table:
            if name in out:
                raise self._bad(f"tensor {name!r} appears twice")
            out[name] = self._tensor(name, dims, kind, self._data_start + offset)
        return out

    def _parse(self) -> tuple[dict[str, Any], list[tuple[str, tuple[int, ...], int, int]], int]:
        buf = self._map
        if buf[:4] != MAGIC:
            raise self._bad(f"magic {bytes(buf[:4])!r}, not {MAGIC!r}")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
        if version not in VERSIONS:
            raise self._bad(f"GGUF version {version} (supported: 2, 3)")
        if num_tensors > len(buf) // 24 or num_kv > len(buf) // 12:  # smallest entries
            raise self._bad(f"{num_tensors} tensors, {num_kv} keys: corrupt")
        pos = 24
        metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key, pos = self._string(pos)
            (kind,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            metadata[key], pos = self._value(kind, pos)
        table = []
        for _ in range(num_tensors):
            name, pos = self._string(pos)
            (ndim,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            if not 1 <= ndim <= 4:
                raise self._bad(f"tensor {name!r} has {ndim} dimensions")
            dims = struct.unpack_from(f"<{ndim}Q", buf, pos)
            kind, offset = struct.unpack_from("<IQ", buf, pos + 8 * ndim)
            pos += 8 * ndim + 12
            table.append((name, dims, kind, offset))
        align = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if align <= 0 or align & (align - 1):
            raise self._bad(f"general.alignment {align} is not a power of two")
        return metadata, table, -(-pos // align) * align

    def _string(self, pos: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", self._map, pos)
        end = pos + 8 + n
        if end > len(self._map):
            raise self._bad("a string runs past the end of the file")
        return self._map[pos + 8 : end].decode("utf-8"), end

    def _value(self, kind: int, pos: int) -> tuple[Any, int]:
        if kind in _SCALARS:
            fmt, size = _SCALARS[kind]
            return struct.unpack_from(fmt, self._map, pos)[0], pos + size
        if kind == _STRING:
            return self._string(pos)
        if kind != _ARRAY:
            raise self._bad(f"unknown GGUF value type {kind} at byte {pos}")
        item, count = struct.unpack_from("<IQ", self._map, pos)
        pos += 12
        if item in _SCALARS:
            fmt, size = _SCALARS[item]
            if pos + count * size > len(self._map):
                raise self._bad("an array runs past the end of the file")
            values = np.frombuffer(self._map, np.dtype(fmt), count, pos)
            return values.tolist(), pos + count * size
        out = []
        for _ in range(count):  # strings (or nested arrays)
            value, pos = self._value(item, pos)
            out.append(value)
        return out, pos

    def _tensor(self, name: str, dims: tuple[int, ...], kind: int, at: int) -> GGUFTensor:
        import gguf

        try:
            qtype = gguf.GGMLQuantizationType(kind)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise self._bad(f"tensor {name!r} has unknown ggml type {kind}") from None
        shape = tuple(reversed(dims))
        if dims[0] % block:
            raise self._bad(f"tensor {name!r}: rows of {dims[0]} in blocks of {block}")
        row_bytes = dims[0] // block * type_size
        num_bytes = row_bytes * math.prod(dims[1:])
        if at + num_bytes > len(self._map):
            raise self._bad(f"tensor {name!r} runs past the end of the file")
        plain = _PLAIN_TYPES.get(kind)
        if plain is not None:
            data = np.frombuffer(self._map, plain, num_bytes // np.dtype(plain).itemsize, at)
            data = data.reshape(shape)
        else:
            data = np.frombuffer(self._map, np.uint8, num_bytes, at).reshape(*shape[:-1], row_bytes)
        return GGUFTensor(name, qtype, shape, data)
