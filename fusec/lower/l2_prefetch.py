"""L2 prefetch ranges for the kernels that stream weights ahead (a pass over the finished task list).

A decode step alternates products, which stream their weights from DRAM, with kernels bound by
latency (the attention), during which DRAM idles. A kernel lowered with ``l2_prefetch`` (its last two
arguments a pointer and a byte count) starts by streaming into L2 the weights of the tasks that
follow it: the products after it then read L2, and the step's DRAM traffic spreads over kernels that
did not use it. Weights are constants, so the prefetch is safe before any PDL wait.

For each such task, in program order: the weight bytes read by the tasks after it, taken while
they are contiguous in the weights space (the packer lays them out in the order of first use), up to
the next prefetching task, at most ``budget`` bytes (a part of L2 the products after it can still
find there: the rest of the step's traffic goes through L2 as well)."""

from __future__ import annotations

from fusec.lower import _ALIGN, Context

# Bytes of weights a kernel streams ahead, by arch major: about half of the L2 (A100 40 MB; H100 and
# H200 50 MB), so what it brings is still there when the products after it read it.
_BUDGET = {8: 16 << 20, 9: 24 << 20}


def budget(arch: str) -> int:
    major = int(arch[3:]) // 10
    return _BUDGET.get(major, _BUDGET[9] if major > 9 else 0)


def prefetch_range(ctx: Context, i: int, limit: int) -> tuple[int, int]:
    """The [lo, hi) weight bytes task ``i`` streams ahead (lo == hi: none)."""
    nxt = set(ctx.l2_prefetchers)
    lo = hi = -1
    for j in range(i + 1, len(ctx.tasks)):
        if j in nxt:
            break
        for r in sorted(r for r in ctx.tasks[j].reads if r.space == "weights" and r.nbytes > 0):
            if lo < 0:
                lo, hi = r.offset, r.end
            elif lo <= r.offset and r.end <= hi:
                continue  # already in the range
            elif hi <= r.offset <= hi + _ALIGN:  # the next weights in the buffer (after the padding)
                hi = max(hi, r.end)
            else:
                return _clip(lo, hi, limit)
            if hi - lo >= limit:
                return _clip(lo, hi, limit)
    return _clip(lo, hi, limit) if lo >= 0 else (0, 0)


def _clip(lo: int, hi: int, limit: int) -> tuple[int, int]:
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
