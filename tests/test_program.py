"""The typed task program (fusec.program): dependencies derived from addresses agree with a
brute-force pairwise read/write overlap, on random programs and on built-in plans' programs."""

from __future__ import annotations

import numpy as np
import pytest

from fusec.program import Region, Task, conflicts, dependencies, tasks_of


def _closure(deps: list[set[int]]) -> list[set[int]]:
    out: list[set[int]] = []
    for d in deps:
        s = set(d)
        for i in d:
            s |= out[i]
        out.append(s)
    return out


def check_program(tasks: list[Task]) -> list[set[int]]:
    deps = dependencies(tasks)
    reach = _closure(deps)
    for j, tj in enumerate(tasks):
        for i in range(j):
            if conflicts(tasks[i], tj):
                assert i in reach[j], f"task {j} ({tj.label}) conflicts with {i} but does not follow it"
        for i in deps[j]:
            assert i < j and conflicts(tasks[i], tj), f"task {j} follows {i} without a conflict"
    return deps


def _random_program(rng: np.random.Generator, n: int) -> list[Task]:
    def regions() -> tuple[Region, ...]:
        return tuple(Region(str(rng.choice(["arena", "state"])), int(rng.integers(0, 200)), int(rng.integers(1, 40)))
                     for _ in range(int(rng.integers(0, 4))))
    return [Task({"type": "kernel", "label": f"t{i}"}, regions(), regions()) for i in range(n)]


@pytest.mark.parametrize("seed", range(20))
def test_dependencies_match_brute_force_on_random_programs(seed: int) -> None:
    check_program(_random_program(np.random.default_rng(seed), 60))


def test_a_read_after_write_a_write_after_read_and_disjoint_tasks() -> None:
    a = Task({"label": "w"}, (), (Region("arena", 0, 16),))
    b = Task({"label": "r"}, (Region("arena", 8, 4),), ())
    c = Task({"label": "other"}, (Region("arena", 100, 4),), (Region("arena", 200, 4),))
    d = Task({"label": "overwrite"}, (), (Region("arena", 10, 1),))
    assert dependencies([a, b, c, d]) == [set(), {0}, set(), {0, 1}]


def test_builtin_generation_plans_program_is_consistent() -> None:
    from fusec.compiler import compile_generation

    plan = compile_generation("qwen3-tiny", batch=2, max_seq_len=64, arch="sm_90", dtype="bf16")
    for name, entry in plan.manifest["entries"].items():
        tasks = tasks_of(entry["launches"])
        assert all(t.writes for t in tasks), f"{name}: a launch that writes nothing"
        deps = check_program(tasks)
        assert sum(map(len, deps)) > 0
        assert any(t.pdl for t in tasks), "no launch of an sm_90 plan overlaps its predecessor"
