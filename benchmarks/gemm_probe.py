"""Probe: cuBLAS through fusec's GemmCall vs torch at transformer GEMM shapes, aligned vs odd N."""

from __future__ import annotations

import torch

from fusec.runtime.cublas import GemmCall, Handle


def bench(fn, iters=50):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / iters


h = Handle()
stream = torch.cuda.current_stream()
for (m, n, k) in [(1024, 50257, 768), (1024, 50264, 768), (1024, 2304, 768), (1024, 3072, 768), (128, 151936, 1024),
                  (128, 4096, 1024)]:
    a = torch.randn(m, k, device="cuda", dtype=torch.float16)
    b = torch.randn(k, n, device="cuda", dtype=torch.float16)
    c = torch.empty(m, n, device="cuda", dtype=torch.float16)
    call = GemmCall(m, n, k, 1, a.data_ptr(), b.data_ptr(), c.data_ptr(), k, n, n, 0, 0, 0, False, False, "f16", "f32")
    t_ours = bench(lambda call=call: call(h, stream.cuda_stream))
    ref = a.float() @ b.float()
    err = float((c.float() - ref).norm() / ref.norm())
    t_torch = bench(lambda a=a, b=b, c=c: torch.matmul(a, b, out=c))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        call(h, torch.cuda.current_stream().cuda_stream)
    t_graph = bench(g.replay)
    tf = 2 * m * n * k / 1e9
    print(f"m={m} n={n} k={k}: fusec {t_ours * 1e3:7.1f} us ({tf / t_ours:6.0f} TF/s)  graph {t_graph * 1e3:7.1f} us"
          f"  torch {t_torch * 1e3:7.1f} us ({tf / t_torch:6.0f} TF/s)  err {err:.1e}")
