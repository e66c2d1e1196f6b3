"""A GGUF file's header, read fast: its metadata as Python values and its tensors as views of the mapped file.

The `gguf` package's `GGUFReader` builds a numpy view per part of every field; a 49k-token vocabulary with its
merges is ~250k views, 2.5 s of a SmolLM2 run's start-up on an H100 host (6 s on a 2-core CPU), for metadata that
a sequential `struct` pass decodes in a tenth of that (#62). This reader keeps the surface `monorl.model.gguf` uses
(`get_field(key).contents()`, `tensors[i].name / shape / tensor_type / data`) and the package's numerics: the
quantization types, block sizes and byte layouts come from `gguf.constants`, and the tensors' `data` have the
shapes `GGUFReader` gives them, so `gguf.quants.dequantize` reads them the same way.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# GGUF value types (gguf.constants.GGUFValueType): struct formats of the scalars, little-endian
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
# tensor types stored as plain numbers (the others as bytes per row, as GGUFReader lays them out)
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class Field:
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass(frozen=True)
class Tensor:
    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray  # GGUF's order: the inner dimension first
    n_elements: int
    n_bytes: int
    data: np.ndarray  # a view of the mapped file, shaped as GGUFReader shapes it


class GGUFHeader:
    """The parsed header of one file; tensor data stay in the page cache until read."""

    def __init__(self, path: Path) -> None:
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = memoryview(self._map)
        if bytes(buf[:4]) != MAGIC:
            raise ValueError(f"not a GGUF file (magic {bytes(buf[:4])!r})")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version} is too old (2 or later)")
        self.pos = 24
        self.fields: dict[str, Field] = {}
        for _ in range(n_kv):
            key = self._string(buf)
            (vtype,) = self._unpack(buf, "<I")
            self.fields[key] = Field(self._value(buf, vtype))
        infos = []
        for _ in range(n_tensors):
            name = self._string(buf)
            (n_dims,) = self._unpack(buf, "<I")
            dims = np.array(self._unpack(buf, f"<{n_dims}Q"), dtype=np.uint64)
            qtype, offset = self._unpack(buf, "<IQ")
            infos.append((name, dims, qtype, offset))
        align = int(self.fields["general.alignment"].value) if "general.alignment" in self.fields else 32
        start = -(-self.pos // align) * align
        self.tensors: list[Tensor] = []
        for name, dims, raw_type, offset in infos:
            qtype = GGMLQuantizationType(raw_type)
            n = int(np.prod(dims))
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = n * type_size // block
            np_dims = tuple(int(d) for d in reversed(dims.tolist()))
            if (plain := _PLAIN.get(qtype.name)) is not None:
                data = np.frombuffer(self._map, dtype=plain, count=n, offset=start + offset).reshape(np_dims)
            else:
                data = np.frombuffer(self._map, dtype=np.uint8, count=n_bytes, offset=start + offset)
                data = data.reshape(quant_shape_to_byte_shape(np_dims, qtype))
            self.tensors.append(Tensor(name, qtype, dims, n, n_bytes, data))

    def get_field(self, key: str) -> Field | None:
        return self.fields.get(key)

    def _unpack(self, buf: memoryview, fmt: str) -> tuple:
        out = struct.unpack_from(fmt, buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out

    def _string(self, buf: memoryview) -> str:
        (n,) = struct.unpack_from("<Q", buf, self.pos)
        s = str(buf[self.pos + 8:self.pos + 8 + n], "utf-8")
        self.pos += 8 + n
        return s

    def _value(self, buf: memoryview, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string(buf)
        if vtype != _ARRAY:
            return self._unpack(buf, _SCALARS[vtype])[0]
        etype, count = self._unpack(buf, "<IQ")
        if etype == _STRING:
            return [self._string(buf) for _ in range(count)]
        if etype == _ARRAY:
            return [self._value(buf, _ARRAY) for _ in range(count)]
        arr = np.frombuffer(buf, dtype=_NUMPY[etype], count=count, offset=self.pos)
        self.pos += arr.nbytes
        return arr.tolist()
