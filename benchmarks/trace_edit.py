"""One-off edits of the working tree's templates for finer block traces (benchmarks/block_trace.py), applied on the
device's copy before a traced run and never committed: they change what the trace marks, not what kernels compute
(`twice` computes the attention's scores twice, the same instructions, so that the second pass runs warm).

    python benchmarks/trace_edit.py keyloop|twice [clock]  &&  bash benchmarks/gpu_session.sh atr2

keyloop  the decode attention's marks: 1 prologue done, 2 q in registers, 3 scores (dots and shuffles) done, 4 key
         loop done, 5 key groups merged (the cluster merge's marks dropped)
twice    the scores section run twice in a loop of two (one copy of its code): 2 before it, 3 after the first pass,
         4 after the second, 5 the key loop done
clock    phase marks from the SM's clock64, anchored at the PDL wait's %globaltimer and converted at 1.98 GHz
         (start, wait and end marks stay %globaltimer): rules out the timer's own behaviour
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KV = ROOT / "templates" / "kv_attention.cu.jinja"
COMMON = ROOT / "templates" / "common.cuh"


def _replace_once(s: str, old: str, new: str) -> str:
    if s.count(old) != 1:
        raise SystemExit(f"trace_edit: the template changed; expected one {old[:60]!r}")
    return s.replace(old, new)


def _marks(s: str, renumber: dict[int, int]) -> str:
    """Each FC_TRACE_PHASE(n) line renumbered (to 0: dropped)."""
    out = []
    for ln in s.split("\n"):
        n = next((k for k in renumber if ln.strip().startswith(f"FC_TRACE_PHASE({k})")), None)
        if n is not None:
            if not renumber[n]:
                continue
            ln = ln.replace(f"FC_TRACE_PHASE({n})", f"FC_TRACE_PHASE({renumber[n]})")
        out.append(ln)
    return "\n".join(out)


QR_END = "{% if not prefetch and not heads %}\n  KV_BOUNDS\n  const int jpre = start;  // nothing loaded before the wait\n{% endif %}\n{% if splits > 1 %}"
SCORES = "    float sc[U][R];\n#pragma unroll\n    for (int u = 0; u < U; ++u) {"
SCORES_END = "        sc[u][r] = vis ? dot : NEG_INF;\n      }\n    }\n"


def keyloop(s: str) -> str:
    s = _marks(s, {2: 4, 3: 5, 4: 0, 5: 0})
    s = _replace_once(s, QR_END, "  FC_TRACE_PHASE(2);\n" + QR_END)
    return _replace_once(s, SCORES_END, SCORES_END + "    FC_TRACE_PHASE(3);\n")


def twice(s: str) -> str:
    s = _marks(s, {2: 5, 3: 0, 4: 0, 5: 0})
    s = _replace_once(s, SCORES, "    float sc[U][R];\n    FC_TRACE_PHASE(2);\n#pragma unroll 1\n"
                                 "    for (int rep = 0; rep < 2; ++rep) {\n    if (rep) FC_TRACE_PHASE(3);\n"
                                 "    unsigned zbits;  // an opaque 0.f: the passes cannot merge\n"
                                 "    asm volatile(\"mov.u32 %0, 0;\" : \"=r\"(zbits));\n"
                                 "#pragma unroll\n    for (int u = 0; u < U; ++u) {")
    s = _replace_once(s, "        float dot = 0.f;\n#pragma unroll\n        for (int n = 0; n < NV; ++n)",
                      "        float dot = __uint_as_float(zbits);\n#pragma unroll\n        for (int n = 0; n < NV; ++n)")
    return _replace_once(s, SCORES_END, SCORES_END + "    }\n    FC_TRACE_PHASE(4);\n")


MARK = """__device__ __forceinline__ void fc_trace_mark(int slot) {
  const unsigned b = fc_block_id();
  if (threadIdx.x == 0 && threadIdx.y == 0 && b < FC_TRACE_BLOCKS) fc_trace[b * FC_TRACE_SLOTS + slot] = fc_now();
}"""
CLOCK_MARK = """__shared__ unsigned long long fc_trace_g0;
__shared__ long long fc_trace_c0;
__device__ __forceinline__ void fc_trace_mark(int slot) {
  const unsigned b = fc_block_id();
  if (threadIdx.x == 0 && threadIdx.y == 0 && b < FC_TRACE_BLOCKS) {
    if (slot >= 5) {  // a phase: the SM's cycles since the wait, as ns at 1.98 GHz
      fc_trace[b * FC_TRACE_SLOTS + slot] = fc_trace_g0 + (unsigned long long)((double)(clock64() - fc_trace_c0) / 1.98);
      return;
    }
    const unsigned long long g = fc_now();
    if (slot == 2) {  // past the PDL wait: the anchor
      fc_trace_c0 = clock64();
      fc_trace_g0 = g;
    }
    fc_trace[b * FC_TRACE_SLOTS + slot] = g;
  }
}"""


def main(argv: list[str]) -> int:
    edits = set(argv)
    if not edits or edits - {"keyloop", "twice", "clock"} or {"keyloop", "twice"} <= edits:
        raise SystemExit(__doc__)
    if edits & {"keyloop", "twice"}:
        s = KV.read_text()
        KV.write_text(keyloop(s) if "keyloop" in edits else twice(s))
    if "clock" in edits:
        COMMON.write_text(_replace_once(COMMON.read_text(), MARK, CLOCK_MARK))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
