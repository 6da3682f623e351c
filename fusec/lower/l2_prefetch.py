"""L2 prefetch ranges (a pass over the finished task list): which weights a prefetching kernel streams
into L2 before its PDL wait.

A decode step alternates products, which stream their weights from DRAM, with the attention, which is
bound by latency: DRAM idles while it runs. The product launched after the attention is resident
during it (PDL), loading its own weights; its blocks also start streaming the weights of the task after
it into L2 (``GemvSpec.l2_prefetch``: params ``pf``, ``pf_bytes``), so that task reads L2 instead of
waiting for DRAM after the product ends. Measured on an H200 (benchmarks/block_trace.py): gate/up's
blocks could not become resident beside o's, so its 12.6 MB started loading only when o ended, and its
wait passed 6 us later.

For each prefetching task whose previous task reads (almost) no weights (``IDLE_BYTES``): the weights the next task
reads, taken while they are contiguous in the weights space, at most ``budget`` bytes (a part of L2
the next task can still find there). Every other prefetching task keeps its empty range (the kernel
prefetches nothing). An earlier form, the attention streaming the next 24 MB from its own start, was
slower: those bytes queued ahead of the attention's cache loads (benchmarks/RESULTS.md, seventh
session)."""

from __future__ import annotations

from fusec.lower import _ALIGN, Context

# Bytes of weights a kernel streams ahead, by arch major: about half of the L2 (A100 40 MB; H100 and
# H200 50 MB), so what it brings is still there when the next task reads it.
_BUDGET = {8: 16 << 20, 9: 24 << 20}
# A task leaves DRAM idle when it reads fewer weight bytes than this and than an eighth of the next
# task's (the attention reads only its q/k norm weights).
IDLE_BYTES = 1 << 20


def budget(arch: str) -> int:
    major = int(arch[3:]) // 10
    return _BUDGET.get(major, _BUDGET[9] if major > 9 else 0)


def weight_bytes(ctx: Context, j: int) -> int:
    return sum(r.nbytes for r in ctx.tasks[j].reads if r.space == "weights")


def prefetch_range(ctx: Context, i: int, limit: int) -> tuple[int, int]:
    """The [lo, hi) weight bytes task ``i`` streams ahead (lo == hi: none)."""
    if i == 0 or i + 1 >= len(ctx.tasks) or weight_bytes(ctx, i - 1) >= min(IDLE_BYTES, weight_bytes(ctx, i + 1) // 8):
        return 0, 0
    lo = hi = -1
    for r in sorted(r for r in ctx.tasks[i + 1].reads if r.space == "weights" and r.nbytes > 0):
        if lo < 0:
            lo, hi = r.offset, r.end
        elif r.offset <= hi + _ALIGN:  # the next weights in the buffer (after the padding)
            hi = max(hi, r.end)
        else:
            break
        if hi - lo >= limit:
            break
    if lo < 0:
        return 0, 0
    hi = min(hi, lo + limit)
    return lo, lo + -(-(hi - lo) // _ALIGN) * _ALIGN  # whole 256-byte units: every packed tensor is padded to them


def assign_l2_prefetch(ctx: Context) -> None:
    """Fill in each prefetching task's range (its arguments and the bytes it reads)."""
    from fusec.program import Region

    limit = budget(ctx.arch)
    for i in ctx.l2_prefetchers:
        lo, hi = prefetch_range(ctx, i, limit) if limit else (0, 0)
        if hi <= lo:
            continue  # the range stays empty: the kernel prefetches nothing
        t = ctx.tasks[i]
        t.record["args"][-2:] = [["ptr", "weights", lo], ["i64", hi - lo]]
        t.reads = t.reads + (Region("weights", lo, hi - lo),)
