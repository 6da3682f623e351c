"""The closed set of element types fusec knows, and their host (numpy) representation.

bf16 has no numpy type of its own; ``ml_dtypes.bfloat16`` supplies it on the host.
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

    @property
    def np(self) -> np.dtype:
        return _TO_NP[self]

    @property
    def itemsize(self) -> int:
        return int(_TO_NP[self].itemsize)

    @property
    def is_float(self) -> bool:
        return self in (DType.F32, DType.F16, DType.BF16)

    @property
    def is_int(self) -> bool:
        return self in (DType.I64, DType.I32)

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
                 "half": "f16", "bfloat16": "bf16", "int64": "i64", "int32": "i32"}
        t = alias.get(t, t)
        for d in DType:
            if d.value == t:
                return d
        raise ValueError(f"unknown dtype {text!r} (expected one of fp32, fp16, bf16, int64, int32, bool)")


_TO_NP: dict[DType, np.dtype] = {
    DType.F32: np.dtype(np.float32),
    DType.F16: np.dtype(np.float16),
    DType.BF16: np.dtype(ml_dtypes.bfloat16),
    DType.I64: np.dtype(np.int64),
    DType.I32: np.dtype(np.int32),
    DType.BOOL: np.dtype(np.bool_),
}
