"""Plans read fast (issue 11, item 5): the file is mapped, each part hashed once and only when used
(``inspect`` never reads the weights), the source model is recorded by digest (no path), the
toolchain is recorded and checked at load, and a plan can be re-targeted to another arch."""

from __future__ import annotations

import copy
import hashlib
import json
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import fusec
from fusec.errors import FusecError
from fusec.plan import Plan
from fusec.planenv import PlanArchError, PlanToolchainError, PlanToolchainWarning, check
from fusec.planfile import FORMAT_VERSION, PlanFile, PlanFileError, read_plan, write_plan


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("planio")
    path = d / "g.fplan"
    fusec.compile("gpt2-tiny").save(path)
    return path


@pytest.fixture
def checked(monkeypatch) -> list[str]:
    """The name of every blob whose checksum is computed, in order."""
    names: list[str] = []
    real = PlanFile._check

    def spy(self, name, entry):
        names.append(name)
        return real(self, name, entry)

    monkeypatch.setattr(PlanFile, "_check", spy)
    return names


def _weights_offset(path) -> int:
    """Byte offset of the weights blob in the file (from the container's own table)."""
    raw = path.read_bytes()
    mlen = int.from_bytes(raw[12:20], "little")
    man = json.loads(raw[20:20 + mlen])
    start = 20 + mlen + (-(20 + mlen)) % 256
    return start + next(b["offset"] for b in man["blobs"] if b["name"] == "weights")


def test_inspect_reads_the_kernels_but_never_the_weights(capsys, plan_file, checked) -> None:
    from fusec.cli import main

    assert main(["inspect", str(plan_file)]) == 0
    out = capsys.readouterr().out
    assert "weights" not in checked
    modules = fusec.load(plan_file).manifest["modules"]
    assert {m["cubin"] for m in modules} | {m["source"] for m in modules} <= set(checked)
    assert "launches per run" in out


def test_every_part_is_hashed_once(plan_file, checked) -> None:
    plan = Plan.load(plan_file, verify="all")
    names = read_plan(plan_file, verify="lazy").names()
    assert sorted(checked) == sorted(names)  # each blob once, nothing else
    for name in names:
        plan.blob(name)
    bytes(plan.blob("weights"))
    assert sorted(checked) == sorted(names)  # later uses hash nothing again


def test_changed_weights_are_caught_when_first_used(tmp_path, plan_file) -> None:
    raw = bytearray(plan_file.read_bytes())
    raw[_weights_offset(plan_file) + 100] ^= 0x20
    bad = tmp_path / "bad.fplan"
    bad.write_bytes(bytes(raw))
    plan = fusec.load(bad)  # the manifest and the kernels are fine: loads
    assert plan.info()["launches"] > 0
    with pytest.raises(PlanFileError, match=r"bad\.fplan: blob 'weights': checksum mismatch"):
        plan.blob("weights")
    with pytest.raises(PlanFileError, match="blob 'weights': checksum mismatch"):
        plan.save(tmp_path / "copy.fplan")  # a broken part is never re-hashed into a valid file
    assert not (tmp_path / "copy.fplan").exists()
    with pytest.raises(PlanFileError, match="blob 'weights': checksum mismatch"):
        Plan.load(bad, verify="all")


def test_a_file_of_another_size_than_its_table_is_refused(tmp_path, plan_file) -> None:
    raw = plan_file.read_bytes()
    p = tmp_path / "t.fplan"
    p.write_bytes(raw[:-32] + b"\0" * 256 + raw[-32:])  # data inserted before the trailer
    with pytest.raises(PlanFileError, match="blob table describes"):
        read_plan(p, verify="lazy")
    p.write_bytes(raw[:_weights_offset(plan_file) + 10])
    with pytest.raises(PlanFileError, match="truncated"):
        read_plan(p, verify="lazy")


@pytest.mark.parametrize("old", [1, 2])
def test_an_older_format_plan_is_refused_with_a_recompile_hint(tmp_path, plan_file, old: int) -> None:
    """Format 2 plans held 5- and 6-bit packed weights' high bits as bit planes: read now, they would decode wrong."""
    raw = bytearray(plan_file.read_bytes())
    raw[8:12] = old.to_bytes(4, "little")
    p = tmp_path / "old.fplan"
    p.write_bytes(bytes(raw))
    assert FORMAT_VERSION == 3
    with pytest.raises(PlanFileError, match=f"format_version is {old}, this fusec reads 3; recompile"):
        fusec.load(p)


def test_a_loaded_plan_saves_to_an_identical_file(tmp_path, plan_file) -> None:
    out = tmp_path / "again.fplan"
    fusec.load(plan_file).save(out)
    assert out.read_bytes() == plan_file.read_bytes()


# ---- the source record --------------------------------------------------------------------------

def _add_model(path) -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8], np.arange(8, dtype=np.float32))
    g = helper.make_graph([helper.make_node("Add", ["x", "w"], ["y"])], "g", [x], [y], [w])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


def test_the_source_is_recorded_by_digest_not_by_path(tmp_path) -> None:
    model = tmp_path / "deep" / "model.onnx"
    model.parent.mkdir()
    _add_model(model)
    plan = fusec.compile(str(model))
    src = plan.manifest["source"]
    assert src["model"] == "model.onnx" and src["kind"] == "file"
    assert src["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    assert str(tmp_path) not in json.dumps(plan.manifest)
    builtin = fusec.compile("gpt2-tiny", disabled_fusions=["gemm_epilogue"]).manifest["source"]
    assert builtin["model"] == "gpt2-tiny" and builtin["kind"] == "builtin" and len(builtin["sha256"]) == 64
    assert builtin["options"] == {"disabled_fusions": ["gemm_epilogue"]}
    from_proto = fusec.compile(onnx.load(model)).manifest["source"]
    assert from_proto["kind"] == "memory" and from_proto["sha256"] is None and from_proto["model"] is None


def test_a_plan_without_the_new_fields_is_refused_naming_them(plan_file) -> None:
    pf = read_plan(plan_file)
    blobs = {n: bytes(pf.blob(n)) for n in pf.names()}
    for field in ("driver_version", "source"):
        m = copy.deepcopy(pf.manifest)
        del m[field]
        with pytest.raises(PlanFileError, match=f"missing field '{field}'"):
            Plan(m, blobs)
    m = copy.deepcopy(pf.manifest)
    m["source"]["sha256"] = "/home/someone/model.onnx"
    with pytest.raises(PlanFileError, match="source.sha256"):
        Plan(m, blobs)


# ---- toolchain checks ---------------------------------------------------------------------------

HERE = {"cupy_version": "14.2.0", "driver_version": "13.0"}


def _m(**kw):
    m = {"arch": "sm_90", "nvrtc_version": "13.0", "cupy_version": "14.2.0", "driver_version": "none"}
    m.update(kw)
    return m


def test_the_toolchain_is_recorded_at_compile(plan_file) -> None:
    from fusec.codegen.compile import nvrtc_version
    from fusec.device import gpu_available

    m = fusec.load(plan_file).manifest
    assert m["nvrtc_version"] == ".".join(map(str, nvrtc_version()))
    import cupy

    assert m["cupy_version"] == cupy.__version__
    if not gpu_available():
        assert m["driver_version"] == "none"


def test_load_refuses_another_arch_naming_the_field() -> None:
    with pytest.raises(PlanArchError, match=r"plan compiled for sm_90 but this GPU is sm_80 \(field 'arch'\)"):
        check(_m(), "p.fplan", "sm_80", HERE)
    assert check(_m(), "p.fplan", "sm_80", HERE, arch_ok=True) == []


def test_a_newer_nvrtc_major_is_refused_a_newer_minor_warned() -> None:
    with pytest.raises(PlanToolchainError, match="field 'nvrtc_version'.*CUDA 12.8"):
        check(_m(nvrtc_version="13.0"), "p.fplan", "sm_90", {**HERE, "driver_version": "12.8"})
    with pytest.warns(PlanToolchainWarning, match="field 'nvrtc_version'"):
        notes = check(_m(nvrtc_version="13.1"), "p.fplan", "sm_90", HERE)
    assert len(notes) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check(_m(nvrtc_version="12.4"), "p.fplan", "sm_90", HERE) == []


def test_other_cupy_and_driver_majors_are_warned() -> None:
    with pytest.warns(PlanToolchainWarning) as rec:
        notes = check(_m(cupy_version="13.6.0", driver_version="14.0"), "p.fplan", "sm_90", HERE)
    text = " ".join(str(w.message) for w in rec)
    assert len(notes) == 2 and "field 'cupy_version'" in text and "field 'driver_version'" in text


# ---- re-targeting ---------------------------------------------------------------------------------

def test_recompile_from_the_kernel_sources(tmp_path, plan_file) -> None:
    from fusec.plancheck import cubin_arch
    from fusec.retarget import recompile

    out = tmp_path / "g80.fplan"
    recompile(plan_file, "sm_80", out)
    old, new = fusec.load(plan_file), Plan.open(out, verify="all")  # open: no GPU arch check here
    assert new.arch == "sm_80"
    for m in new.manifest["modules"]:
        assert cubin_arch(bytes(new.blob(m["cubin"]))) == 80
    assert new.manifest["launches"] == old.manifest["launches"]
    assert bytes(new.blob("weights")) == bytes(old.blob("weights"))


def test_recompile_from_the_recorded_source(tmp_path) -> None:
    from fusec.retarget import recompile

    model = tmp_path / "model.onnx"
    _add_model(model)
    plan_path = tmp_path / "m.fplan"
    fusec.compile(str(model), dtype="fp32").save(plan_path)
    new = recompile(plan_path, "sm_80", tmp_path / "m80.fplan", from_source=True)
    assert new.arch == "sm_80" and new.dtype == "fp32"
    assert new.manifest["source"] == fusec.load(plan_path).manifest["source"]
    model.write_bytes(model.read_bytes() + b"\0")  # not the file the plan was compiled from
    with pytest.raises(FusecError, match="sha256 differs"):
        recompile(plan_path, "sm_80", tmp_path / "x.fplan", from_source=True)
    in_memory = tmp_path / "p.fplan"
    fusec.compile(_proto(tmp_path)).save(in_memory)  # an in-memory ModelProto
    with pytest.raises(FusecError, match="records no source model"):
        recompile(in_memory, "sm_80", tmp_path / "y.fplan", from_source=True)
    assert not (tmp_path / "x.fplan").exists() and not (tmp_path / "y.fplan").exists()


def _proto(tmp_path):
    p = tmp_path / "other.onnx"
    _add_model(p)
    return onnx.load(p)


def test_recompile_refuses_a_kernel_whose_shared_memory_does_not_fit(tmp_path, plan_file) -> None:
    from fusec.retarget import recompile

    pf = read_plan(plan_file)
    m = copy.deepcopy(pf.manifest)
    m["kernels"][0]["smem"] = 120_000  # fits sm_90 (227 KiB), not sm_86 (99 KiB)
    big = tmp_path / "big.fplan"
    write_plan(big, m, {n: pf.blob(n) for n in pf.names()})
    with pytest.raises(FusecError, match=r"kernel #0 .* 120000 bytes of shared memory, more than sm_86"):
        recompile(big, "sm_86", tmp_path / "o.fplan")
    with pytest.raises(FusecError, match="--arch"):
        recompile(big, "hopper", tmp_path / "o.fplan")


def test_saving_a_checked_plan_hashes_nothing_again(tmp_path, plan_file, monkeypatch) -> None:
    import fusec.planfile as planfile

    plan = Plan.load(plan_file, verify="all")
    hashed: list[int] = []
    real = planfile._sha256
    monkeypatch.setattr(planfile, "_sha256", lambda data: hashed.append(memoryview(data).nbytes) or real(data))
    plan.save(tmp_path / "same.fplan")
    assert hashed == []  # every part's digest came from the checked file
    plan._recompile("sm_80")
    plan.save(tmp_path / "sm80.fplan")
    assert len(hashed) == len(plan.manifest["modules"])  # only the new cubins are hashed
    assert Plan.open(tmp_path / "sm80.fplan", verify="all").arch == "sm_80"
