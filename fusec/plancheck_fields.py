"""The vocabulary of a plan manifest's validation (``fusec.plancheck``): its limits, its key sets,
and ``FieldCheck``, the typed checks of one field each that raise a ``PlanFileError`` naming it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fusec.planfile import PlanFileError

MAX_BYTES = 2**44  # no region (arena, weights, state) is larger than 16 TiB
MAX_DIM = 2**40
MAX_DEPTH = 32  # nesting of the manifest's JSON
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_BLOCK = (1024, 1024, 64)
MAX_THREADS = 1024
MAX_SMEM = 232448  # 227 KiB: the largest opt-in shared memory per block of any arch fusec targets
DTYPES = {"f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "bool": 1}
PLAN_DTYPES = ("fp32", "tf32", "fp16", "bf16")
ARCH_RE = re.compile(r"sm_([0-9]{2,3})[a-z]?")
VERSION_RE = re.compile(r"[0-9A-Za-z.+_-]{1,64}")
IDENT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,200}")
SCALARS = {"i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1), "u64": (0, 2**64 - 1), "f32": None}
EM_CUDA = 190

TOP_KEYS = {"fusec_version", "nvrtc_version", "cupy_version", "driver_version", "arch", "dtype", "cuda_graph", "model",
            "source", "memory", "modules", "kernels", "report", "reports", "inputs", "outputs", "launches", "entries",
            "state", "generation", "ab"}
# format 2: the toolchain (fusec.planenv) and the source record are required; older plans: recompile
REQUIRED = ("fusec_version", "nvrtc_version", "cupy_version", "driver_version", "arch", "dtype", "source", "memory",
            "modules", "kernels")
SOURCE_KEYS = {"model", "kind", "sha256", "shapes", "options"}
SOURCE_KINDS = ("builtin", "file", "memory", "other")
# fusec.compile's options a plan records (loader.source_record): a re-target from source passes them
# back to fusec.compile as keywords, so no other key (e.g. dump_dir, a path to write to) may pass
SOURCE_OPTIONS = {"disabled_fusions", "enabled_fusions", "fusion_overrides", "choices", "fp32_gemm", "quantize",
                  "quantize_group", "quantize_head"}
FP32_GEMM_MODES = ("3xtf32", "sgemm")  # passes/split_tf32.MODES (not imported: plancheck stays light)
SHA256_RE = re.compile(r"[0-9a-f]{64}")
MEMORY_KEYS = {"arena_bytes", "weights_bytes", "scratch_bytes", "state_bytes", "naive_bytes", "planned_bytes",
               "lower_bound_bytes"}
MODULE_KEYS = {"id", "cubin", "source", "entry", "template"}
KERNEL_KEYS = {"module", "entry", "smem"}
SIG_KEYS = {"name", "shape", "dtype", "offset", "bound"}
ENTRY_KEYS = {"inputs", "outputs", "launches", "arena_bytes"}
KERNEL_LAUNCH_KEYS = {"type", "kernel", "grid", "block", "smem", "args", "label", "reads", "writes", "pdl"}
GEMM_KEYS = {"type", "m", "n", "k", "batch", "lda", "ldb", "ldc", "stride_a", "stride_b", "stride_c", "trans_a",
             "trans_b", "dtype", "compute", "a", "b", "c", "label", "alpha", "beta", "epilogue", "bias", "c_in",
             "reads", "writes"}
# bias, c_in: cuBLASLt epilogues; reads/writes: the program's regions (fusec.program)
GEMM_OPTIONAL = ("label", "alpha", "beta", "epilogue", "bias", "c_in", "reads", "writes")
GEMM_DTYPES = {"f32": 4, "f16": 2, "bf16": 2}
GEMM_COMPUTE = ("f32", "tf32")
# a generation plan (fusec.compiler.compile_generation; read by fusec.runtime.generation, fusec generate,
# fusec.generation.check_prompts, fusec.report.subject): its entry points and its "generation" record
GEN_ENTRIES = ("prefill", "decode")  # and "admit" where the record has an admit_batch, "join" where it has a join count
GEN_KEYS = {"entry", "batch", "max_seq_len", "prefill_len", "eos_ids", "vocab_size", "num_layers", "source",
            "tokenizer", "admit_batch", "join"}
GEN_REQUIRED = ("entry", "batch", "max_seq_len", "prefill_len", "eos_ids", "vocab_size", "num_layers", "source")
TOKENIZER_KEYS = {"bos_id", "eos_ids", "add_bos", "chat_template"}
MAX_CHAT_TEMPLATE = 1 << 20
# the kernel sources' preprocessor directives: what fusec's templates use (define, pragma unroll and
# once), and what cannot read a file (undef, the conditionals: __has_include is refused on its own)
DIRECTIVES = ("define", "undef", "if", "ifdef", "ifndef", "elif", "else", "endif", "pragma")
PRAGMA_RE = re.compile(r"(?:unroll|nounroll)(?:[ \t(][\w \t()+*/-]*)?|once[ \t]*")
# identifiers a source may not hold: they read files, or make a pragma without a directive (``##``
# could paste one together, so no source pastes tokens: fusec's templates never do)
SOURCE_REFUSED = ("__has_include", "__has_embed", "_Pragma", "__pragma", "##", "%:%:")


# The longest string a manifest field holds unless the field says otherwise (input/output names,
# the model's name...); fusec.compiler checks a model's names against it before compiling.
MAX_NAME = 4096

class FieldCheck:
    """Checks of one manifest field each: type, range, keys; each failure a PlanFileError naming the field."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, msg: str) -> PlanFileError:
        return PlanFileError(f"{self.where}: manifest: field {field!r}: {msg}")

    # ---- typed getters ---------------------------------------------------------------------
    def obj(self, v: Any, field: str, keys: set[str] | None = None, required: tuple[str, ...] = ()) -> Mapping[str, Any]:
        if not isinstance(v, Mapping):
            raise self.fail(field, f"must be an object, got {_kind(v)}")
        if keys is not None:
            unknown = sorted(str(k) for k in v if k not in keys)
            if unknown:
                raise self.fail(field, f"unknown key(s) {', '.join(repr(k[:40]) for k in unknown[:5])}")
        for k in required:
            if k not in v:
                raise self.fail(field, f"missing key {k!r}")
        return v

    def arr(self, v: Any, field: str, max_len: int = 10**7) -> list[Any]:
        if not isinstance(v, list):
            raise self.fail(field, f"must be a list, got {_kind(v)}")
        if len(v) > max_len:
            raise self.fail(field, f"has {len(v)} items, more than {max_len}")
        return v

    def int(self, v: Any, field: str, lo: int = 0, hi: int = MAX_BYTES) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(field, f"must be an integer, got {_kind(v)}")
        if not lo <= v <= hi:
            raise self.fail(field, f"{v} is outside [{lo}, {hi}]")
        return v

    def str(self, v: Any, field: str, pattern: re.Pattern[str] | None = None, max_len: int = MAX_NAME) -> str:
        if not isinstance(v, str):
            raise self.fail(field, f"must be a string, got {_kind(v)}")
        if len(v) > max_len:
            raise self.fail(field, f"is {len(v)} characters long, more than {max_len}")
        if pattern is not None and not pattern.fullmatch(v):
            raise self.fail(field, f"{_shown(v)} is not of the expected form {pattern.pattern!r}")
        return v

    def choice(self, v: Any, field: str, options: Any) -> str:
        """A string, one of ``options`` (checked a string first: a list or an object is no dict key)."""
        if not isinstance(v, str) or v not in options:
            raise self.fail(field, f"{_shown(v)} is not one of {', '.join(options)}")
        return v

    def num(self, v: Any, field: str, lo: float, hi: float) -> float:
        """A number (an integer or a float, not a boolean) in [lo, hi]."""
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.fail(field, f"must be a number, got {_kind(v)}")
        if not lo <= v <= hi:
            raise self.fail(field, f"{v} is outside [{lo}, {hi}]")
        return v

    def bool(self, v: Any, field: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(field, f"must be true or false, got {_kind(v)}")
        return v

    def shape(self, v: Any, field: str) -> list[int]:
        dims = self.arr(v, field, max_len=16)
        return [self.int(d, f"{field}[{i}]", 0, MAX_DIM) for i, d in enumerate(dims)]

    def span(self, space: str, off: int, nbytes: int, limits: Mapping[str, int], field: str) -> None:
        """``[off, off + nbytes)`` lies inside region ``space`` (a zero-size span still starts inside)."""
        if space not in limits:
            raise self.fail(field, f"unknown memory space {_shown(space)} (expected {', '.join(limits)})")
        limit = limits[space]
        if off >= limit and not (nbytes == 0 and off <= limit):
            raise self.fail(field, f"pointer {space}+{off} is at or past the end of the {space} ({limit} bytes)")
        if off + nbytes > limit:
            raise self.fail(field, f"{space}+{off} with {nbytes} bytes runs past the end of the {space} ({limit} bytes)")


def _kind(v: Any) -> str:
    return "null" if v is None else {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
                                     int: "an integer", float: "a number"}.get(type(v), type(v).__name__)


def _shown(s: Any) -> str:
    """A value from the file, safe to print: escaped (no terminal control sequences), cut short."""
    text = repr(s)
    return (text[:60] + "...") if len(text) > 60 else text
