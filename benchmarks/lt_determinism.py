"""Which cuBLASLt candidates give bit-identical results run to run (GPU only).

For small products with an epilogue (the shapes of tests/test_epilogue_lt.py) and a few larger
ones, every candidate the heuristic offers (``fusec.runtime.cublaslt.MAX_ALGOS``) runs ``--repeats``
times into fresh outputs; the report lists, per candidate, its algorithm id, tile, split-K count,
reduction scheme and whether all runs were bitwise equal. Usage: ``python benchmarks/lt_determinism.py OUT.json``.
"""

from __future__ import annotations

import ctypes
import json
import sys

import numpy as np

# cublasLtMatmulAlgoConfigAttributes_t
_CONFIG = {"id": 0, "tile": 1, "splitk": 2, "reduction": 3, "swizzle": 4, "custom": 5, "stages": 6}
SHAPES = [(4, 96, 64), (4, 96, 64 * 3), (64, 256, 1024), (1024, 768, 3072), (24, 256, 64)]


def config(lt, i: int) -> dict:
    out = {}
    fn = lt._lib.cublasLtMatmulAlgoConfigGetAttribute
    for name, attr in _CONFIG.items():
        v, written = ctypes.c_uint32(0), ctypes.c_size_t(0)
        rc = fn(ctypes.byref(lt.candidates[i].algo), attr, ctypes.byref(v), ctypes.sizeof(v), ctypes.byref(written))
        out[name] = int(v.value) if rc == 0 else f"rc{rc}"
    return out


def main(out_path: str, repeats: int = 6) -> None:
    import cupy

    from fusec.runtime.cublas import WORKSPACE_BYTES, GemmCall, Handle
    from fusec.runtime.cublaslt import LtMatmul

    handle = Handle()
    rng = np.random.default_rng(0)
    rows = []
    for dtype, np_dt, compute in (("f32", np.float32, "f32"), ("f32", np.float32, "tf32"), ("f16", np.float16, "f32")):
        for (m, n, k) in SHAPES:
            for epi in ("gelu_bias", "relu_bias", "bias", "default"):
                a = cupy.asarray(rng.standard_normal((m, k)).astype(np_dt))
                b = cupy.asarray((rng.standard_normal((k, n)) / 8).astype(np_dt))
                bias = cupy.asarray(rng.standard_normal(n).astype(np_dt))
                c = cupy.zeros((m, n), np_dt)
                call = GemmCall(m, n, k, 1, a.data.ptr, b.data.ptr, c.data.ptr, k, n, n, 0, 0, m * n, False, False,
                                dtype, compute, epilogue=epi, bias=bias.data.ptr if "bias" in epi else None)
                lt = LtMatmul(call, handle.lt(), handle.workspace.data.ptr, WORKSPACE_BYTES)
                stream = cupy.cuda.Stream(non_blocking=True)
                for i in range(len(lt.candidates)):
                    outs = []
                    for _ in range(repeats):
                        d = cupy.full((m, n), np.nan, np_dt)
                        rc = lt.enqueue(stream.ptr, i, d.data.ptr)
                        stream.synchronize()
                        outs.append(None if rc else cupy.asnumpy(d))
                    ok = [o for o in outs if o is not None]
                    same = bool(ok) and all(np.array_equal(ok[0], o, equal_nan=True) for o in ok[1:])
                    rows.append({"dtype": dtype, "compute": compute, "m": m, "n": n, "k": k, "epilogue": epi,
                                 "candidate": i, "of": len(lt.candidates), "failed_runs": len(outs) - len(ok),
                                 "bitwise_same": same, **config(lt, i)})
                    if not same:
                        print("NONDETERMINISTIC", rows[-1], flush=True)
                lt.close()
    bad = [r for r in rows if not r["bitwise_same"]]
    summary = {"candidates": len(rows), "nondeterministic": len(bad),
               "nondeterministic_by_reduction": sorted({(r["reduction"], r["splitk"]) for r in bad}),
               "deterministic_reductions_seen": sorted({(r["reduction"], r["splitk"]) for r in rows if r["bitwise_same"]})}
    print(json.dumps(summary))
    with open(out_path, "w") as f:
        json.dump({"summary": summary, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
