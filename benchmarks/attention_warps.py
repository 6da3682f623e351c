"""The fp16/bf16 attention kernel at 1, 2, 4 and 8 warps per block, at the attention shapes of
the issue-13 workloads (GPU only).

    python benchmarks/attention_warps.py [OUT.json]

Each variant is launched 50 times inside one CUDA graph (so host launch latency is not timed, as
in a plan's graph), the graph replayed 20 times between CUDA events: the median per launch.
Q/K/V are each read from L2 after the first launch, as in a plan where the QKV product has just
written them. ``auto`` is what ``AttentionSpec.block_warps`` picks.
"""

from __future__ import annotations

import json
import math
import statistics
import sys

import numpy as np

from fusec.codegen import kernels as K
from fusec.codegen import specs as S
from fusec.dtypes import DType

F16, BF16 = DType.F16, DType.BF16
SHAPES = {  # name: B, Hq, Hkv, S, D, dtype, causal, padding mask
    "qwen3-0.6b 1x128": (1, 16, 8, 128, 128, BF16, True, False),
    "gpt2-small 8x128": (8, 12, 12, 128, 64, F16, True, True),
    "bert-base 32x128": (32, 12, 12, 128, 64, F16, False, True),
    "minilm 32x128": (32, 12, 12, 128, 32, F16, False, True),
}


def _f32(x, dt: DType):  # noqa: ANN001, ANN202
    import cupy as cp

    return x.astype(cp.float32) if dt == F16 else (x.astype(cp.uint32) << 16).view(cp.float32)


def main(argv: list[str]) -> int:
    import cupy as cp

    out: dict = {"device": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(), "shapes": {}}
    stream = cp.cuda.Stream(non_blocking=True)
    for name, (b, hq, hkv, s, d, dt, causal, padded) in SHAPES.items():
        rng = np.random.default_rng(0)

        def rand(shape: tuple[int, ...]):  # noqa: ANN202 -- fp16, or bf16 bits (fp32 truncated)
            x = rng.standard_normal(shape).astype(np.float32)
            return cp.asarray(x.astype(np.float16) if dt == F16 else (x.view(np.uint32) >> 16).astype(np.uint16))

        q, k, v = rand((b, hq, s, d)), rand((b, hkv, s, d)), rand((b, hkv, s, d))
        o = cp.empty_like(q)
        kw: dict = {}
        args = [q, k, v]
        if padded:
            m = np.zeros((b, 1, 1, s), np.float16)
            m[b // 2:, ..., s * 3 // 4:] = -1e4
            args.append(cp.asarray(m))
            kw = dict(mask="additive", mask_dtype=F16, mask_strides=(s, 0, 0, 1))
        args.append(o)
        row: dict = {"auto": S.AttentionSpec(b, hq, hkv, s, s, d, dt, 1 / math.sqrt(d), causal=causal, **kw).block_warps()}
        ref = None
        for w in (1, 2, 4, 8):
            spec = S.AttentionSpec(b, hq, hkv, s, s, d, dt, 1 / math.sqrt(d), causal=causal, warps=w, **kw)
            ck = K.build(spec)
            with stream:
                K.launch(ck, args, stream)
                stream.synchronize()
                got = o.copy()
                ref = got if ref is None else ref
                diff = float(cp.abs(_f32(got, dt) - _f32(ref, dt)).max())
                stream.begin_capture()
                for _ in range(50):
                    K.launch(ck, args, stream)
                g = stream.end_capture()
                g.launch(stream)
                stream.synchronize()
                t = []
                for _ in range(20):
                    a, e = cp.cuda.Event(), cp.cuda.Event()
                    a.record(stream)
                    g.launch(stream)
                    e.record(stream)
                    e.synchronize()
                    t.append(cp.cuda.get_elapsed_time(a, e) * 1000 / 50)
            row[f"warps{w}"] = {"us": statistics.median(t), "grid": list(ck.grid), "block": list(ck.block),
                                "max_diff_vs_warps1": diff}
        out["shapes"][name] = row
        best = min((1, 2, 4, 8), key=lambda w: row[f"warps{w}"]["us"])
        print(f"{name}: " + "  ".join(f"w{w} {row[f'warps{w}']['us']:.2f} us" for w in (1, 2, 4, 8))
              + f"  | auto w{row['auto']}, best w{best}; max diff vs w1 "
              + f"{max(row[f'warps{w}']['max_diff_vs_warps1'] for w in (2, 4, 8)):.2e}", flush=True)
    if len(argv) > 0:
        with open(argv[0], "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
