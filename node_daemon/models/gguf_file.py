"""A GGUF file read for loading: its metadata decoded in one pass, its tensors as views of the mapped file.

gguf.GGUFReader builds a numpy memmap view for every part of every field: 8 s of start-up for SmolLM2's 49k-token
vocabulary and 48k merges on a busy 2-core machine. This reads the same header with struct from one read-only
mmap (strings in a plain loop, numeric arrays as one frombuffer each) in tens of milliseconds; tensor data is
never copied here, the arrays are views of the mapping (pages are read as the loader touches them).

Fields decode as GGUFReader's `contents()` does: scalars to Python numbers, strings to str, arrays to lists.
Tensors carry what the loader reads from GGUFReader's: name, shape (GGUF order: ne0 first), tensor_type (gguf's
GGMLQuantizationType) and data (numpy, dimensions reversed; quantized types as uint8 rows of block bytes).
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUFValueType -> struct format of one scalar (8: string, 9: array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray


class GGUFFile:
    def __init__(self, path: str) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._map
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_fields = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 and later are)")
        self.path, self.version = path, version
        self._off = 24
        self.fields: dict[str, Any] = {}
        for _ in range(n_fields):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(kind), offset))
        align = int(self.fields.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-self._off // align) * align
        self.tensors: list[GGUFTensor] = []
        for name, dims, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims)) if dims else 1
            nbytes = count // block * type_size
            if start + offset + nbytes > len(buf):
                raise ValueError(f"{path}: tensor {name} runs past the end of the file")
            rows = tuple(reversed(dims))
            if qtype.name in ("F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"):
                dtype = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64, "I8": np.int8,
                         "I16": np.int16, "I32": np.int32, "I64": np.int64}[qtype.name]
                data = np.frombuffer(buf, dtype=dtype, count=count, offset=start + offset).reshape(rows)
            else:
                data = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start + offset)
                data = data.reshape(*rows[:-1], rows[-1] // block * type_size)
            self.tensors.append(GGUFTensor(name, dims, qtype, data))

    # --- header parsing ------------------------------------------------------------------------------

    def _unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self._map, self._off)
        self._off += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (n,) = struct.unpack_from("<Q", self._map, self._off)
        start = self._off + 8
        self._off = start + n
        return self._map[start:start + n].decode("utf-8", errors="replace")

    def _value(self, kind: int) -> Any:
        if kind == _STRING:
            return self._string()
        if kind == _ARRAY:
            item, count = self._unpack("<IQ")
            if item == _STRING:
                return [self._string() for _ in range(count)]
            if item == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[item]).newbyteorder("<")
            values = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._off)
            self._off += values.nbytes
            return values.tolist()
        if kind not in _SCALARS:
            raise ValueError(f"{self.path}: unknown GGUF value type {kind}")
        (value,) = self._unpack(_SCALARS[kind])
        return value
