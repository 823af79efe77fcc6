"""A GGUF file's metadata and tensors, read in one pass over its header.

gguf's own GGUFReader builds a numpy view for every part of every metadata value, a few
hundred thousand of them for a tokenizer's vocabulary and merges, which costs seconds on each
load. The loader needs the scalar metadata, the tensors' names, types and bytes, and only the
lengths of the big arrays, so this reads the header with struct, keeps arrays of strings as
their lengths unless asked, and maps the tensor data without copying it. The tensors come
out as GGUFReader gives them (same dtype and shape per type), so gguf.dequantize takes them.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF value type -> struct format of one item (8 string, 9 array are read by hand)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# GGML types stored as plain numbers: their dtype (every other type is blocks, read as uint8)
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFArrayLength:
    """An array of strings that was not read (keep_strings): only how many items it holds."""
    length: int

    def __len__(self) -> int:
        return self.length


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # as stored: the fastest-varying dimension first
    data: np.ndarray  # read-only view of the file, shaped as GGUFReader shapes it


@dataclass(frozen=True)
class GGUFFile:
    fields: dict[str, Any]  # key -> int, float, bool, str, list, or GGUFArrayLength
    tensors: list[GGUFTensor]


def read_gguf(path: str, keep_strings: bool = False) -> GGUFFile:
    """Read `path`'s metadata and tensor directory; the tensors' data stays in the file (mapped).
    Arrays of strings are kept only with `keep_strings` (else their length). ValueError for a
    file that is not a little-endian GGUF of version 2 or 3."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as fh:
        buf = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    if buf[:4] != GGUF_MAGIC:
        raise ValueError(f"{path}: not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3; a big-endian file reads as "
                         "neither)")
    pos = 24
    u64 = struct.Struct("<Q")

    def string(p: int) -> tuple[str, int]:
        (n,) = u64.unpack_from(buf, p)
        return buf[p + 8:p + 8 + n].decode("utf-8"), p + 8 + n

    def value(kind: int, p: int) -> tuple[Any, int]:
        if kind == _STRING:
            return string(p)
        if kind == _ARRAY:
            item, count = struct.unpack_from("<IQ", buf, p)
            p += 12
            if item == _STRING:
                if keep_strings:
                    out = []
                    for _ in range(count):
                        s, p = string(p)
                        out.append(s)
                    return out, p
                for _ in range(count):  # skip: only the lengths are read
                    p += 8 + u64.unpack_from(buf, p)[0]
                return GGUFArrayLength(count), p
            if item == _ARRAY:
                out = []
                for _ in range(count):
                    v, p = value(_ARRAY, p)
                    out.append(v)
                return out, p
            fmt = _SCALARS[item]
            size = struct.calcsize(fmt)
            return list(struct.unpack_from(f"<{count}{fmt}", buf, p)), p + count * size
        fmt = _SCALARS[kind]
        return struct.unpack_from("<" + fmt, buf, p)[0], p + struct.calcsize(fmt)

    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key, pos = string(pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        fields[key], pos = value(kind, pos + 4)
    infos = []
    for _ in range(n_tensors):
        name, pos = string(pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        kind, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        infos.append((name, dims, GGMLQuantizationType(kind), offset))
    align = fields.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"{path}: general.alignment {align!r} is not a power of two")
    start = pos + (-pos) % align
    whole = np.frombuffer(buf, dtype=np.uint8)
    tensors, names = [], set()
    for name, dims, kind, offset in infos:
        if name in names:
            raise ValueError(f"{path}: tensor {name!r} appears twice")
        names.add(name)
        n = int(np.prod(dims)) if dims else 1
        shape = tuple(reversed(dims))
        block, type_size = GGML_QUANT_SIZES[kind]
        plain = _PLAIN.get(kind.name)
        begin = start + offset
        if plain is not None:
            data = whole[begin:begin + n * np.dtype(plain).itemsize].view(plain).reshape(shape)
        else:
            row = shape[-1] // block * type_size
            data = whole[begin:begin + n * type_size // block].reshape(*shape[:-1], row)
        tensors.append(GGUFTensor(name, kind, tuple(dims), data))
    return GGUFFile(fields, tensors)
