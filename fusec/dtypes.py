"""The closed set of element types fusec knows, and their host (numpy) representation.

bf16 has no numpy type of its own; ``ml_dtypes.bfloat16`` supplies it on the host.

Every dtype runs on the reference backend. Generated CUDA code handles the ``on_gpu`` ones
(f32, f16, bf16, i64, i32, bool); the lowering refuses a node on any other dtype in one line
naming the op and the dtype (``fusec.lower``).
"""

from __future__ import annotations

import enum

import ml_dtypes
import numpy as np


class DType(enum.Enum):
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    I64 = "i64"
    I32 = "i32"
    BOOL = "bool"
    F64 = "f64"
    I16 = "i16"
    I8 = "i8"
    U8 = "u8"
    U16 = "u16"
    U32 = "u32"
    U64 = "u64"

    @property
    def np(self) -> np.dtype:
        return _TO_NP[self]

    @property
    def itemsize(self) -> int:
        return int(_TO_NP[self].itemsize)

    @property
    def is_float(self) -> bool:
        return self in _FLOATS

    @property
    def is_int(self) -> bool:
        return self in _INTS

    @property
    def is_signed(self) -> bool:
        """A signed integer or a float (bool and unsigned integers are not)."""
        return self in _FLOATS or self in (DType.I64, DType.I32, DType.I16, DType.I8)

    @property
    def on_gpu(self) -> bool:
        """Whether generated CUDA code has a type for it (the others run on the reference only)."""
        return self in _ON_GPU

    def __repr__(self) -> str:  # short form used by the printer and error messages
        return self.value

    @staticmethod
    def from_np(dt: np.dtype | type) -> DType:
        """The DType of a numpy dtype; raises ValueError naming the dtype if fusec has none."""
        key = np.dtype(dt)
        for d, n in _TO_NP.items():
            if n == key:
                return d
        raise ValueError(f"unsupported element type {key} (fusec supports {', '.join(d.value for d in DType)})")

    @staticmethod
    def parse(text: str) -> DType:
        """Parse a user-facing dtype name such as 'fp16', 'f16', 'float16', 'bf16'."""
        t = text.strip().lower()
        alias = {"fp32": "f32", "float32": "f32", "float": "f32", "fp16": "f16", "float16": "f16",
                 "half": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32", "fp64": "f64",
                 "float64": "f64", "double": "f64", "int16": "i16", "int8": "i8", "uint8": "u8",
                 "uint16": "u16", "uint32": "u32", "uint64": "u64"}
        t = alias.get(t, t)
        for d in DType:
            if d.value == t:
                return d
        raise ValueError(f"unknown dtype {text!r} (expected one of fp32, fp16, bf16, int64, int32, bool, fp64, "
                         "int16, int8, uint8, uint16, uint32, uint64)")


_TO_NP: dict[DType, np.dtype] = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.I64: np.dtype(np.int64),
    DType.I32: np.dtype(np.int32),
    DType.BOOL: np.dtype(np.bool_),
    DType.F64: np.dtype(np.float64),
    DType.I16: np.dtype(np.int16),
    DType.I8: np.dtype(np.int8),
    DType.U8: np.dtype(np.uint8),
    DType.U16: np.dtype(np.uint16),
    DType.U32: np.dtype(np.uint32),
    DType.U64: np.dtype(np.uint64),
}
_FLOATS = frozenset({DType.F32, DType.F16, DType.BF16, DType.F64})
_INTS = frozenset({DType.I64, DType.I32, DType.I16, DType.I8, DType.U8, DType.U16, DType.U32, DType.U64})
_ON_GPU = frozenset({DType.F32, DType.F16, DType.BF16, DType.I64, DType.I32, DType.BOOL})
