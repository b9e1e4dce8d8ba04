"""The GGUF container, read and checked in plain Python.

:func:`read_gguf_header` parses a GGUF file's header, metadata and tensor
table and checks every count, length, type and offset against the file's size
before MLX's GGUF reader is given the file; :class:`_Fields` reads metadata
values with their types and ranges checked. A truncated, corrupt or hostile
file raises :class:`GGUFError` (a ``ValueError``) naming the file, the field
and the bad value. Turning the checked file into an mlx-lm model and tokenizer
is the job of :mod:`turboquant_mlx.gguf`, which re-exports the public names.
"""

from __future__ import annotations

import math
import os
import struct
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import mlx.core as mx

__all__ = [
    "read_gguf_header",
    "GGUFHeader",
    "GGUFTensorInfo",
    "GGUFError",
]


# --------------------------------------------------------------------------
# Errors and the GGUF header reader


class GGUFError(ValueError):
    """A GGUF file this loader cannot use: truncated, malformed, inconsistent with
    itself, or describing a model the loader does not support.

    Attributes:
        path: the file (None when only a metadata dict was given).
        field: the header field, metadata key or tensor at fault.
        problem: what is wrong with it, including the offending value.
    """

    def __init__(self, path: Optional[str], field: str, problem: str):
        self.path, self.field, self.problem = path, field, problem
        where = repr(path) if path is not None else "GGUF metadata"
        super().__init__(f"[load_gguf] {where}: {field}: {problem}")


def _show(name: str, limit: int = 96) -> str:
    """repr of a name from the file, cut short (messages stay one short line)."""
    return repr(name) if len(name) <= limit else repr(name[:limit]) + "..."


# Metadata value types of the GGUF format.
_GGUF_STRING, _GGUF_ARRAY, _GGUF_BOOL = 8, 9, 7
_GGUF_VALUE_FORMATS = {  # type -> (struct format, size)
    0: ("B", 1),
    1: ("b", 1),
    2: ("H", 2),
    3: ("h", 2),
    4: ("I", 4),
    5: ("i", 4),
    6: ("f", 4),
    7: ("B", 1),
    10: ("Q", 8),
    11: ("q", 8),
    12: ("d", 8),
}
_GGUF_VALUE_NAMES = {
    0: "uint8",
    1: "int8",
    2: "uint16",
    3: "int16",
    4: "uint32",
    5: "int32",
    6: "float32",
    7: "bool",
    8: "string",
    9: "array",
    10: "uint64",
    11: "int64",
    12: "float64",
}

# ggml tensor types: id -> (name, elements per block, bytes per block).
_GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# What MLX's GGUF reader turns into model weights: Q4_0/Q4_1/Q8_0 become MLX
# affine-quantized weights, the others are converted to float16.
_SUPPORTED_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q2_K", "Q4_K", "Q6_K"}
_FLOAT_TYPES = {"F32", "F16", "BF16"}

_GGML_MAX_DIMS = 4
# MLX shapes are int32 and its GGUF reader counts elements in int.
_MAX_ELEMENTS = 2**31 - 1
_DEFAULT_ALIGNMENT = 32
# Smallest encodings: a key-value pair (empty key, uint8 value) and a tensor
# info (empty name, one dimension).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_INFO_BYTES = 8 + 4 + 8 + 4 + 8


class GGUFTensorInfo(NamedTuple):
    """One entry of a GGUF tensor table, checked against the file.

    ``shape`` is in MLX (row-major) order, the reverse of GGUF's dimension
    order; ``offset`` is absolute (from the start of the file).
    """

    name: str
    shape: Tuple[int, ...]
    type_name: str
    offset: int
    nbytes: int


class GGUFHeader(NamedTuple):
    """The checked header of a GGUF file (see :func:`read_gguf_header`)."""

    path: str
    version: int
    metadata: Dict[str, Any]
    metadata_types: Dict[str, int]
    tensors: Dict[str, GGUFTensorInfo]
    alignment: int
    data_offset: int
    file_size: int


class _Reader:
    """Sequential little-endian reads of a file, never past its size.

    Every read first checks the request against the bytes left in the file, so
    a corrupt length or count costs neither memory nor time; the file is read in
    chunks and consumed bytes are dropped.
    """

    _CHUNK = 1 << 20

    def __init__(self, f, size: int, path: str):
        self.f, self.size, self.path = f, size, path
        self.buf = bytearray()
        self.start = 0  # file offset of buf[0]
        self.pos = 0  # read position in buf

    @property
    def offset(self) -> int:
        return self.start + self.pos

    def remaining(self) -> int:
        return self.size - self.offset

    def need(self, n: int, field: str):
        left = self.size - self.offset
        if n > left:
            raise GGUFError(
                self.path,
                field,
                f"needs {n} bytes at offset {self.offset}, but the file has only {left} "
                f"left (truncated or corrupt file)",
            )
        have = len(self.buf) - self.pos
        if n > have:
            del self.buf[: self.pos]
            self.start += self.pos
            self.pos = 0
            want = min(max(n - have, self._CHUNK), self.size - self.start - len(self.buf))
            while len(self.buf) < n:
                chunk = self.f.read(want - (len(self.buf) - have))
                if not chunk:
                    raise GGUFError(self.path, field, "the file shrank while it was being read")
                self.buf += chunk

    def bytes(self, n: int, field: str) -> bytes:
        self.need(n, field)
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def unpack(self, fmt: str, size: int, field: str):
        self.need(size, field)
        out = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return out

    def u32(self, field: str) -> int:
        return self.unpack("I", 4, field)[0]

    def u64(self, field: str) -> int:
        return self.unpack("Q", 8, field)[0]

    def string(self, field: str) -> str:
        n = self.u64(f"{field} (length)")
        raw = self.bytes(n, field)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(
                self.path, field, f"is not valid UTF-8 ({e.reason} at byte {e.start} of {n})"
            ) from None

    def strings(self, count: int, field: str) -> List[str]:
        """``count`` strings (the fast path of string arrays: labels only on error)."""
        # Every string takes at least its 8-byte length: bound the count first.
        self.need(count * 8, f"{field} ({count} strings)")
        out = []
        for i in range(count):
            if self.pos + 8 <= len(self.buf):
                (n,) = struct.unpack_from("<Q", self.buf, self.pos)
                end = self.pos + 8 + n
                if end <= len(self.buf):
                    try:
                        out.append(self.buf[self.pos + 8 : end].decode("utf-8"))
                        self.pos = end
                        continue
                    except UnicodeDecodeError:
                        pass
            out.append(self.string(f"{field}[{i}]"))  # refills the buffer, or raises
        return out

    def value(self, vtype: int, field: str) -> Any:
        fmt = _GGUF_VALUE_FORMATS.get(vtype)
        if fmt is not None:
            v = self.unpack(*fmt, field)[0]
            if vtype == _GGUF_BOOL:
                if v > 1:
                    raise GGUFError(self.path, field, f"bool value is {v}, not 0 or 1")
                return bool(v)
            return v
        if vtype == _GGUF_STRING:
            return self.string(field)
        if vtype == _GGUF_ARRAY:
            return self.array(field)
        raise GGUFError(self.path, field, f"unknown metadata value type {vtype}")

    def array(self, field: str) -> List[Any]:
        etype = self.u32(f"{field} (array element type)")
        n = self.u64(f"{field} (array length)")
        if etype == _GGUF_ARRAY:
            raise GGUFError(self.path, field, "nested arrays are not supported")
        if n > _MAX_ELEMENTS:
            raise GGUFError(self.path, field, f"array length {n} is too large")
        fmt = _GGUF_VALUE_FORMATS.get(etype)
        if fmt is not None:
            code, size = fmt
            self.need(n * size, f"{field} ({n} x {_GGUF_VALUE_NAMES[etype]})")
            if etype == _GGUF_BOOL:
                raw = self.bytes(n, field)
                if raw.translate(None, b"\x00\x01"):
                    raise GGUFError(self.path, field, "bool array holds values other than 0 and 1")
                return [b == 1 for b in raw]
            return list(self.unpack(f"{n}{code}", n * size, field))
        if etype == _GGUF_STRING:
            return self.strings(n, field)
        raise GGUFError(self.path, field, f"unknown array element type {etype}")


def read_gguf_header(path: str) -> GGUFHeader:
    """Read and check the header, metadata and tensor table of a GGUF file.

    Pure Python and bounded by the file: every count and length is checked
    against the bytes the rest of the file can hold before anything is
    allocated or looped over. Checks the magic and version (2 or 3), the
    metadata encoding (value types, UTF-8 strings, booleans), that keys and
    tensor names are unique, ``general.alignment`` (a power of two, uint32),
    every tensor's dimensions (1 to 4, none zero), type (a known ggml type that
    MLX can load), offset (aligned) and size (whole blocks per row, within the
    file, no two tensors overlapping). Nothing is handed to MLX.

    Returns:
        A :class:`GGUFHeader`; metadata values are plain Python values (arrays
        as lists).

    Raises:
        GGUFError: naming the file, the field and the bad value.
        OSError: the file cannot be opened.
    """
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        r = _Reader(f, size, path)
        magic = r.bytes(4, "magic") if size >= 4 else None
        if magic != b"GGUF":
            raise GGUFError(path, "magic", f"expected b'GGUF', found {magic!r}: not a GGUF file")
        version = r.u32("version")
        if version not in (2, 3):
            raise GGUFError(
                path, "version", f"{version} is not supported (only GGUF versions 2 and 3)"
            )
        n_tensors = r.u64("tensor_count")
        n_kv = r.u64("metadata_kv_count")
        if n_kv * _MIN_KV_BYTES + n_tensors * _MIN_TENSOR_INFO_BYTES > r.remaining():
            raise GGUFError(
                path,
                "tensor_count/metadata_kv_count",
                f"{n_tensors} tensors and {n_kv} metadata entries cannot fit in the "
                f"{r.remaining()} bytes left in the file (truncated or corrupt file)",
            )

        metadata: Dict[str, Any] = {}
        types: Dict[str, int] = {}
        for i in range(n_kv):
            key = r.string(f"metadata key {i}")
            vtype = r.u32(f"metadata {_show(key)} (value type)")
            if key in metadata:
                raise GGUFError(path, f"metadata {_show(key)}", "duplicate key")
            metadata[key] = r.value(vtype, f"metadata {_show(key)}")
            types[key] = vtype

        alignment = _DEFAULT_ALIGNMENT
        if "general.alignment" in metadata:
            alignment = metadata["general.alignment"]
            if types["general.alignment"] != 4:
                raise GGUFError(
                    path,
                    "general.alignment",
                    f"must be a uint32, is a {_GGUF_VALUE_NAMES.get(types['general.alignment'])}",
                )
            if alignment <= 0 or alignment & (alignment - 1):
                raise GGUFError(
                    path, "general.alignment", f"must be a power of two, got {alignment}"
                )

        infos, seen = [], set()
        for i in range(n_tensors):
            name = r.string(f"tensor {i} name")
            field = f"tensor {_show(name)}"
            if name in seen:
                raise GGUFError(path, field, "duplicate tensor name")
            seen.add(name)
            n_dims = r.u32(f"{field} n_dims")
            if not 1 <= n_dims <= _GGML_MAX_DIMS:
                raise GGUFError(
                    path, f"{field} n_dims", f"must be between 1 and {_GGML_MAX_DIMS}, got {n_dims}"
                )
            dims = r.unpack(f"{n_dims}Q", 8 * n_dims, f"{field} dims")
            ggml_type = r.u32(f"{field} type")
            offset = r.u64(f"{field} offset")
            infos.append((name, dims, ggml_type, offset))
        data_offset = r.offset + (-r.offset) % alignment

    tensors: Dict[str, GGUFTensorInfo] = {}
    for name, dims, ggml_type, offset in infos:
        field = f"tensor {_show(name)}"
        shape = tuple(reversed(dims))
        if ggml_type not in _GGML_TYPES:
            raise GGUFError(path, f"{field} type", f"unknown ggml type {ggml_type}")
        type_name, block, block_bytes = _GGML_TYPES[ggml_type]
        if type_name not in _SUPPORTED_TYPES:
            raise GGUFError(
                path,
                f"{field} type",
                f"{type_name} is not supported (supported: {', '.join(sorted(_SUPPORTED_TYPES))})",
            )
        if min(dims) == 0:
            raise GGUFError(path, f"{field} dims", f"shape {shape} has a zero dimension")
        n_elements = math.prod(dims)
        if n_elements > _MAX_ELEMENTS:
            raise GGUFError(
                path, f"{field} dims", f"shape {shape} has more than {_MAX_ELEMENTS} elements"
            )
        if dims[0] % block:
            raise GGUFError(
                path,
                f"{field} dims",
                f"rows of {dims[0]} elements are not whole {type_name} blocks of {block}",
            )
        if offset % alignment:
            raise GGUFError(
                path, f"{field} offset", f"{offset} is not a multiple of the alignment {alignment}"
            )
        nbytes = n_elements // block * block_bytes
        start = data_offset + offset
        if start + nbytes > size:
            raise GGUFError(
                path,
                f"{field} offset",
                f"data at {start}..{start + nbytes} ({type_name} {shape}) extends past the end "
                f"of the file ({size} bytes; truncated or corrupt file)",
            )
        tensors[name] = GGUFTensorInfo(name, shape, type_name, start, nbytes)

    end, last = data_offset, None
    for t in sorted(tensors.values(), key=lambda t: t.offset):
        if t.offset < end:
            raise GGUFError(
                path, f"tensor {_show(t.name)} offset", f"its data overlaps that of {_show(last)}"
            )
        end, last = t.offset + t.nbytes, t.name

    return GGUFHeader(path, version, metadata, types, tensors, alignment, data_offset, size)


# --------------------------------------------------------------------------
# Metadata


def _scalar(v: Any) -> Any:
    """GGUF metadata scalars come back from mx.load as 0-d arrays."""
    if isinstance(v, mx.array):
        return v.item() if v.ndim == 0 else v.tolist()
    return v


def _meta(metadata: Dict[str, Any], key: str, default: Any = None) -> Any:
    if key not in metadata:
        return default
    return _scalar(metadata[key])


_REQUIRED = object()


class _Fields:
    """Typed, range-checked reads of GGUF metadata; errors are GGUFErrors."""

    def __init__(self, metadata: Dict[str, Any], path: Optional[str]):
        self.metadata, self.path = metadata, path

    def error(self, key: str, problem: str) -> GGUFError:
        return GGUFError(self.path, key, problem)

    def get(self, key: str, default: Any = _REQUIRED) -> Any:
        v = _meta(self.metadata, key, None)
        if v is None:
            if default is _REQUIRED:
                raise self.error(key, "missing")
            return default
        return v

    def has(self, key: str) -> bool:
        return _meta(self.metadata, key, None) is not None

    def integer(self, key: str, default: Any = _REQUIRED, lo: int = 1, hi: int = 2**31 - 1):
        if default is not _REQUIRED and not self.has(key):
            return default
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(key, f"expected an integer, got {_describe(v)}")
        if not lo <= v <= hi:
            raise self.error(key, f"must be between {lo} and {hi}, got {v}")
        return v

    def number(self, key: str, default: Any = _REQUIRED) -> float:
        if default is not _REQUIRED and not self.has(key):
            return default
        v = self.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.error(key, f"expected a number, got {_describe(v)}")
        if not (math.isfinite(v) and v > 0):
            raise self.error(key, f"must be a finite positive number, got {v!r}")
        return float(v)

    def string(self, key: str, default: Any = _REQUIRED) -> Any:
        if default is not _REQUIRED and not self.has(key):
            return default
        v = self.get(key)
        if not isinstance(v, str):
            raise self.error(key, f"expected a string, got {_describe(v)}")
        return v

    def strings(self, key: str, default: Any = _REQUIRED) -> Any:
        if default is not _REQUIRED and not self.has(key):
            return default
        v = self.get(key)
        if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
            raise self.error(key, f"expected an array of strings, got {_describe(v)}")
        return list(v)


def _describe(v: Any) -> str:
    if isinstance(v, str):
        return _show(v, 80)
    if isinstance(v, (list, tuple)):
        kinds = sorted({type(x).__name__ for x in v})
        return f"an array of {len(v)} ({'/'.join(kinds) or 'no'} elements)"
    return repr(v)[:80]
