"""Hostile input, plan files (issue 10, item 2): a plan is executable code, so a manifest that was
tampered with and re-hashed (the container's checksums then match) is still refused, before any
code loads, with one PlanFileError naming the field: changed kernel sources, random or wrong-arch
cubins, pointer ranges past their region, launch limits, control characters, unknown keys, wrong
types, NaN, 100k-deep nesting."""

from __future__ import annotations

import copy
import hashlib
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from hostile_helpers import fails

import fusec
from fusec.planfile import FORMAT_VERSION, MAGIC, PlanFileError, read_plan, write_plan


# 2 x 32 tokens: products of M = 64 rows, cuBLAS launches with FUSEC_GEMM_STREAM=0 (M <= 16 would be GEMVs)
SHAPES = {"input_ids": (2, 32), "attention_mask": (2, 32)}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[dict, dict]:
    """(manifest, blobs) of a compiled gpt2-tiny plan (sm_90, no GPU needed), its products on cuBLAS (the gemm records
    these tests tamper with; by default sm_90 runs products of at most 128 rows on fusec's GEMM)."""
    d = tmp_path_factory.mktemp("plans")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FUSEC_GEMM_STREAM", "0")
        fusec.compile("gpt2-tiny", shapes=SHAPES).save(d / "g.fplan")
    pf = read_plan(d / "g.fplan")
    return pf.manifest, {n: bytes(pf.blob(n)) for n in pf.names()}


def _tampered(tmp_path: Path, base, edit) -> Path:
    manifest, blobs = copy.deepcopy(base[0]), dict(base[1])
    edit(manifest, blobs)
    path = tmp_path / "t.fplan"
    write_plan(path, manifest, blobs)  # re-hashed: the container itself is consistent
    return path


def _refused(path: Path, *needles: str) -> str:
    with pytest.raises(PlanFileError) as ei:
        fusec.load(path)
    msg = str(ei.value)
    assert "\n" not in msg and "\x1b" not in msg and "t.fplan" in msg, msg
    for n in needles:
        assert n in msg, (n, msg)
    return msg


def _first_kernel(m: dict) -> dict:
    return next(L for L in m["launches"] if L["type"] == "kernel")


def _first_gemm(m: dict) -> dict:
    return next(L for L in m["launches"] if L["type"] == "gemm")


def test_the_untampered_plan_loads(tmp_path, base) -> None:
    assert fusec.load(_tampered(tmp_path, base, lambda m, b: None)).arch == "sm_90"


def _cubin_for(arch: str) -> bytes:
    from fusec.codegen.compile import compile_cuda

    return compile_cuda('extern "C" __global__ void k(float* x) { x[0] = 1; }', "k", arch, use_disk=False).cubin


CASES = {
    "kernel source that includes a file": (
        lambda m, b: b.__setitem__(m["modules"][0]["source"], b'#include "/etc/passwd"\n' + b[m["modules"][0]["source"]]),
        ["module 'm0'", "includes a file"]),
    "kernel source without its entry": (
        lambda m, b: b.__setitem__(m["modules"][0]["source"], b'extern "C" __global__ void other() {}'),
        ["module 'm0'", "does not define its entry"]),
    "random cubin": (
        lambda m, b: b.__setitem__(m["modules"][0]["cubin"], bytes(np.random.default_rng(0).integers(0, 256, 4096, np.uint8))),
        ["module 'm0'", "not a CUDA ELF cubin"]),
    "cubin for another arch": (
        lambda m, b: b.__setitem__(m["modules"][0]["cubin"], _cubin_for("sm_80")),
        ["module 'm0'", "sm_80", "'arch' is sm_90"]),
    "input extent past the arena end": (
        lambda m, b: m["inputs"][0].__setitem__("offset", m["memory"]["arena_bytes"] - 8),
        ["inputs[0].offset", "runs past the end of the arena"]),
    "kernel pointer at the arena end": (
        lambda m, b: _first_kernel(m)["args"].__setitem__(0, ["ptr", "arena", m["memory"]["arena_bytes"]]),
        ["launches[0].args[0]", "at or past the end of the arena"]),
    "pointer into an unknown space": (
        lambda m, b: _first_kernel(m)["args"].__setitem__(0, ["ptr", "host", 0]),
        ["launches[0].args[0]", "unknown memory space 'host'"]),
    "gemm operand past the weights": (
        lambda m, b: _first_gemm(m).__setitem__("b", ["weights", m["memory"]["weights_bytes"] - 64]),
        [".b'", "runs past the end of the weights"]),
    "gemm leading dimension too small": (
        lambda m, b: _first_gemm(m).__setitem__("lda", 1),
        [".lda'", "less than"]),
    "grid 2^40": (lambda m, b: _first_kernel(m).__setitem__("grid", [2**40, 1, 1]), ["launches[0].grid[0]", "outside"]),
    "block of 2048 threads": (lambda m, b: _first_kernel(m).__setitem__("block", [2048, 1, 1]), ["launches[0].block[0]"]),
    "shared memory 2^31": (lambda m, b: _first_kernel(m).__setitem__("smem", 2**31), ["launches[0].smem", "outside"]),
    "arch with a terminal escape": (lambda m, b: m.__setitem__("arch", "\x1b[2J\x1b[31msm_90"), ["'arch'", "\\x1b"]),
    "label with a terminal escape": (lambda m, b: _first_kernel(m).__setitem__("label", "\x1b]0;pwned\x07"),
                                     ["launches[0].label", "control characters"]),
    "unknown top-level key": (lambda m, b: m.__setitem__("run_this", "rm -rf /"), ["unknown field", "'run_this'"]),
    "unknown launch key": (lambda m, b: _first_kernel(m).__setitem__("stream", 7), ["launches[0]", "'stream'"]),
    "input shape that is a string": (lambda m, b: m["inputs"][0].__setitem__("shape", "1x16"),
                                     ["inputs[0].shape", "must be a list"]),
    "arena size that is a string": (lambda m, b: m["memory"].__setitem__("arena_bytes", "45312"),
                                    ["memory.arena_bytes", "must be an integer"]),
    "NaN size": (lambda m, b: m["memory"].__setitem__("arena_bytes", float("nan")), ["NaN"]),
    "infinite size": (lambda m, b: m["memory"].__setitem__("naive_bytes", float("inf")), ["Infinity"]),
    "boolean kernel index": (lambda m, b: _first_kernel(m).__setitem__("kernel", True), ["launches[0].kernel"]),
    "negative offset": (lambda m, b: m["outputs"][0].__setitem__("offset", -256), ["outputs[0].offset", "outside"]),
    "unknown dtype": (lambda m, b: m["outputs"][0].__setitem__("dtype", "f8"), ["outputs[0].dtype", "'f8'"]),
    "kernel entry that is not an identifier": (
        lambda m, b: [k.__setitem__("entry", "k; system()") for k in m["kernels"]] and
        [x.__setitem__("entry", "k; system()") for x in m["modules"]], ["modules[0].entry"]),
    "state record past the state region": (
        lambda m, b: m.__setitem__("state", [{"name": "s", "shape": [4], "dtype": "f32", "offset": 0}]),
        ["state 's'", "outside the state region"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_re_hashed_tampered_plan_is_refused(tmp_path, base, case) -> None:
    edit, needles = CASES[case]
    _refused(_tampered(tmp_path, base, edit), *needles)


def _raw_plan(path: Path, manifest_bytes: bytes) -> Path:
    """A container around arbitrary manifest bytes (no blobs), with a correct trailer."""
    head = struct.pack("<8sIQ", MAGIC, FORMAT_VERSION, len(manifest_bytes)) + manifest_bytes
    head += b"\0" * ((-len(head)) % 256)
    path.write_bytes(head + hashlib.sha256(head).digest())
    return path


@pytest.mark.parametrize("text", [
    b'{"blobs": [], "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"blobs": [], "x": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}",
    b'{"blobs": [{"name": "w", "offset": "0", "length": [], "sha256": 1}]}',
    b'{"blobs": [], "fusec_version": "0.1.0", "arch": NaN}',
    b'[1, 2, 3]',
    b'{"blobs": {"a": 1}}',
])
def test_malformed_manifest_json_is_one_plan_error(capsys, tmp_path, text) -> None:
    path = _raw_plan(tmp_path / "t.fplan", text)
    with pytest.raises(PlanFileError) as ei:
        fusec.load(path)
    assert "\n" not in str(ei.value) and "t.fplan" in str(ei.value)
    fails(capsys, ["inspect", str(path)], needles=["t.fplan", "manifest"])


def test_deep_but_valid_json_elsewhere_in_the_manifest_is_refused(tmp_path, base) -> None:
    def deep(m, b):
        v: object = 1
        for _ in range(100):
            v = [v]
        m["report"]["deep"] = v

    _refused(_tampered(tmp_path, base, deep), "nested more than")


def test_cli_prints_tampered_plans_as_one_escaped_line(capsys, tmp_path, base) -> None:
    path = _tampered(tmp_path, base, lambda m, b: m.__setitem__("arch", "\x1b[31msm_90"))
    for cmd in (["inspect", str(path)], ["inspect", str(path), "--json"]):
        msg = fails(capsys, cmd, needles=["t.fplan", "'arch'"])
        assert "\x1b" not in msg


def test_in_memory_plans_are_validated_too(base) -> None:
    from fusec.plan import Plan

    m, b = copy.deepcopy(base[0]), dict(base[1])
    _first_kernel(m)["grid"] = [1, 1, 2**20]
    with pytest.raises(PlanFileError, match="grid"):
        Plan(m, b)


def test_manifest_json_is_what_the_compiler_writes(base) -> None:
    """The strict schema accepts every key the compiler writes (one- and multi-entry plans)."""
    from fusec.compiler import compile_generation
    from fusec.plancheck import validate

    gen = compile_generation("llama-tiny", batch=2, max_seq_len=16)
    validate(json.loads(json.dumps(gen.manifest)), gen.blobs(), "gen", fusec.__version__)
    validate(base[0], base[1], "g", fusec.__version__)
