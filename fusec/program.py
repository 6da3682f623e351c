"""The typed program a lowering emits: a list of tasks over fixed addresses.

A ``Task`` is one launch (a fusec kernel or a cuBLAS(Lt) call): what runs (the launch record the
runtime executes), the byte ranges it reads and writes (``Region``: arena, weights or state
space, offset, length), a label for people, the IR node it computes and whether it may overlap the
task before it (``pdl``: programmatic dependent launch; the kernel then waits for it in-kernel).
The plan stores each task as its launch record with ``reads``/``writes``/``pdl`` added; the launch
list, the CUDA graph, the per-launch profile, ``export-graph``, ``memory`` and ``bisect`` read it.

Dependencies are derived from the addresses (``dependencies``): task j follows task i < j when j
reads bytes i wrote (read after write), writes bytes i read (write after read) or wrote (write
after write). ``dependencies`` returns, per task, the latest earlier tasks it conflicts with on
each byte (a sweep over per-space segment maps); every other conflict follows from these by
transitivity (tests check both against a brute-force pairwise overlap).
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any


@dataclasses.dataclass(frozen=True, order=True)
class Region:
    space: str  # "arena" | "weights" | "state"
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes

    def overlaps(self, other: Region) -> bool:
        return self.space == other.space and self.offset < other.end and other.offset < self.end

    def to_json(self) -> list[Any]:
        return [self.space, self.offset, self.nbytes]

    @classmethod
    def from_json(cls, r: Sequence[Any]) -> Region:
        return cls(str(r[0]), int(r[1]), int(r[2]))


@dataclasses.dataclass
class Task:
    record: dict[str, Any]  # the launch record ("type": "kernel" | "gemm", its fields and "label")
    reads: tuple[Region, ...]
    writes: tuple[Region, ...]
    node: str = ""  # the IR node it computes (for reports; never reaches generated source)
    pdl: bool = False

    @property
    def label(self) -> str:
        return str(self.record.get("label", ""))

    def to_json(self) -> dict[str, Any]:
        out = dict(self.record)
        out["reads"] = [r.to_json() for r in _merge(self.reads)]
        out["writes"] = [r.to_json() for r in _merge(self.writes)]
        if self.pdl:
            out["pdl"] = True
        return out

    @classmethod
    def from_json(cls, rec: Mapping[str, Any]) -> Task:
        record = {k: v for k, v in rec.items() if k not in ("reads", "writes", "pdl")}
        return cls(record, tuple(Region.from_json(r) for r in rec.get("reads", ())),
                   tuple(Region.from_json(r) for r in rec.get("writes", ())), pdl=bool(rec.get("pdl", False)))


def _merge(regions: Iterable[Region]) -> list[Region]:
    """Regions sorted, with overlapping or touching ranges of one space merged."""
    out: list[Region] = []
    for r in sorted(x for x in regions if x.nbytes > 0):
        if out and out[-1].space == r.space and r.offset <= out[-1].end:
            last = out[-1]
            out[-1] = Region(r.space, last.offset, max(last.end, r.end) - last.offset)
        else:
            out.append(r)
    return out


class _Segments:
    """One space's bytes as sorted, disjoint segments, each with its last writer and the readers
    since that write (the state a sweep needs to find each new access's direct conflicts)."""

    def __init__(self) -> None:
        self.starts: list[int] = []
        self.segs: list[list[Any]] = []  # [start, end, writer or -1, set of readers]

    def _split(self, at: int) -> None:
        i = bisect.bisect_right(self.starts, at) - 1
        if i >= 0:
            s = self.segs[i]
            if s[0] < at < s[1]:
                right = [at, s[1], s[2], set(s[3])]
                s[1] = at
                self.segs.insert(i + 1, right)
                self.starts.insert(i + 1, at)

    def cover(self, lo: int, hi: int) -> list[list[Any]]:
        """The segments exactly covering [lo, hi), creating empty ones for untouched bytes."""
        self._split(lo)
        self._split(hi)
        i = bisect.bisect_left(self.starts, lo)
        out: list[list[Any]] = []
        pos = lo
        while pos < hi:
            if i < len(self.segs) and self.segs[i][0] == pos:
                out.append(self.segs[i])
                pos = self.segs[i][1]
                i += 1
            else:
                end = self.segs[i][0] if i < len(self.segs) and self.segs[i][0] < hi else hi
                seg = [pos, end, -1, set()]
                self.segs.insert(i, seg)
                self.starts.insert(i, pos)
                out.append(seg)
                pos = end
                i += 1
        return out


def dependencies(tasks: Sequence[Task]) -> list[set[int]]:
    """For each task, the earlier tasks it must run after (its direct conflicts, see module doc)."""
    spaces: dict[str, _Segments] = {}
    deps: list[set[int]] = []
    for j, t in enumerate(tasks):
        d: set[int] = set()
        for r in _merge(t.reads):
            for seg in spaces.setdefault(r.space, _Segments()).cover(r.offset, r.end):
                if seg[2] >= 0:
                    d.add(seg[2])
        for r in _merge(t.writes):
            for seg in spaces.setdefault(r.space, _Segments()).cover(r.offset, r.end):
                if seg[2] >= 0:
                    d.add(seg[2])
                d.update(seg[3])
        for r in _merge(t.reads):  # record after checking, so a task reading what it writes is fine
            for seg in spaces[r.space].cover(r.offset, r.end):
                seg[3].add(j)
        for r in _merge(t.writes):
            for seg in spaces[r.space].cover(r.offset, r.end):
                seg[2] = j
                seg[3] = set()
        d.discard(j)
        deps.append(d)
    return deps


def conflicts(a: Task, b: Task) -> bool:
    """Whether b (later) must follow a: read after write, write after read or write after write."""
    return any(w.overlaps(r) for w in a.writes for r in b.reads) or \
        any(w.overlaps(x) for w in b.writes for x in (*a.reads, *a.writes))


def tasks_of(launches: Sequence[Mapping[str, Any]]) -> list[Task]:
    return [Task.from_json(L) for L in launches]
