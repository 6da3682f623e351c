"""CUDA code generation: kernel specs -> Jinja templates -> NVRTC CUBIN (+ disk cache) -> launch."""

from __future__ import annotations
