"""Strict validation of a plan's manifest, before any of its code is loaded.

A plan is executable code: its cubins run on the GPU, its sources are compiled by
``recompile=True``. The container's checksums (``fusec.planfile``) only prove the file is whole;
anyone can re-hash a tampered one. So the manifest is checked as hostile input: every field's
type and range, no unknown keys, every pointer range (offset plus extent, where the extent is known)
inside its region, launch limits (grid, block, shared memory), the cubin's ELF header and its arch,
kernel sources that include nothing (every preprocessor directive one fusec writes, found as the
preprocessor finds it), the fields later code reads (a generation plan's record, the report that
``inspect`` prints: types and ranges), source models named, never given as paths, and strings free
of control characters (they are printed).
Every failure is one ``PlanFileError`` naming the field. This does not make an untrusted plan
safe to run: load plans only from trusted sources.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from typing import Any

from fusec.planfile import PlanFileError, blob_length
from fusec.plancheck_launches import check_entry, sig_bytes
from fusec.plancheck_source import check_source
from fusec.plancheck_fields import (
    ARCH_RE, EM_CUDA, ENTRY_KEYS, FP32_GEMM_MODES, GEN_ENTRIES, GEN_KEYS, GEN_REQUIRED, IDENT_RE, KERNEL_KEYS,
    MAX_CHAT_TEMPLATE, MAX_DEPTH, MAX_DIM, MAX_SMEM, MEMORY_KEYS, MODULE_KEYS, PLAN_DTYPES, REQUIRED, SHA256_RE,
    SOURCE_KEYS, SOURCE_KINDS, SOURCE_OPTIONS, TOKENIZER_KEYS, TOP_KEYS, VERSION_RE, FieldCheck, _kind, _shown,
)


_ESCAPED = ("report", "reports", "ab", "generation", "source")


def check_tree(obj: Any, where: str) -> None:
    """The manifest as JSON: bounded depth, finite numbers, strings without control characters
    (an ``arch`` holding an escape sequence must not reach a terminal). Iterative."""
    stack: list[tuple[Any, int, str]] = [(obj, 0, "")]
    while stack:
        v, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise PlanFileError(f"{where}: manifest: field {path or '(top)'!r}: nested more than {MAX_DEPTH} levels deep")
        if isinstance(v, dict):
            for k, x in v.items():
                if not isinstance(k, str) or not k.isprintable():
                    raise PlanFileError(f"{where}: manifest: {path or '(top)'!r} has a key with control characters: "
                                        f"{_shown(k)}")
                stack.append((x, depth + 1, f"{path}.{k}" if path else k))
        elif isinstance(v, list):
            for i, x in enumerate(v):
                stack.append((x, depth + 1, f"{path}[{i}]"))
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise PlanFileError(f"{where}: manifest: field {path!r}: {v} is not a finite number")
        elif isinstance(v, str):
            # names from the model and free text are printed escaped (fmt_name, JSON); every other
            # string (arch, dtype, versions, kernel names, labels) is printed as it is
            if path.startswith(_ESCAPED) or path.endswith(".name") or path == "model":
                continue
            for ch in v:
                o = ord(ch)
                if o < 32 or o == 0x7F or 0x80 <= o < 0xA0:
                    raise PlanFileError(f"{where}: manifest: field {path!r}: string {_shown(v)} holds control characters")


def cubin_arch(data: bytes) -> int | None:
    """The ``sm_XX`` number of a CUDA ELF cubin, or None when ``data`` is not one."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    (machine,) = struct.unpack_from("<H", data, 18)
    if machine != EM_CUDA:
        return None
    (flags,) = struct.unpack_from("<I", data, 48)
    abi = data[8]
    return (flags >> 8) & 0xFF if abi >= 8 else flags & 0xFF


def elf_size(data: bytes) -> int | None:
    """The bytes a 64-bit little-endian ELF's headers say it spans: the end of its program-header table,
    section-header table and sections with file contents (None: not such an ELF, or a header
    outside ``data``)."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
    phent, phnum, shent, shnum = struct.unpack_from("<HHHH", data, 0x36)
    end = max(64, phoff + phent * phnum, shoff + shent * shnum)
    if shoff + shent * shnum > len(data):
        return None
    for i in range(shnum):
        _, typ, _, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shent)
        if typ != 8:  # SHT_NOBITS holds no bytes in the file
            end = max(end, off + size)
    return end


def complete_cubin(data: bytes) -> bytes:
    """``data`` with the byte CuPy's ``nvrtc.getCUBIN`` drops restored. CuPy strips the last byte as if
    it were a string's terminating NUL, but a cubin is an ELF file and that byte is its own: the
    top byte of the last program header's 64-bit alignment, always 0. The driver loads either
    (a Python ``bytes`` ends in a hidden NUL), but the short one is not a valid ELF (nvdisasm
    rejects it). Anything else is returned as it is."""
    end = elf_size(data)
    if end is None or end != len(data) + 1:
        return data
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phent, phnum = struct.unpack_from("<HH", data, 0x36)
    if phnum and phent == 56 and phoff + phent * phnum == end:  # the missing byte ends Elf64_Phdr.p_align
        return data + b"\0"
    return data


def validate(m: Any, blobs: Mapping[str, Any], where: str, fusec_version: str) -> None:
    """Raise PlanFileError naming the field at the first thing wrong with manifest ``m``."""
    c = FieldCheck(where)
    if not isinstance(m, Mapping):
        raise PlanFileError(f"{where}: manifest: must be a JSON object")
    check_tree(m, where)
    unknown = sorted(k for k in m if k not in TOP_KEYS)
    if unknown:
        raise PlanFileError(f"{where}: manifest: unknown field(s) {', '.join(_shown(k) for k in unknown[:5])}")
    for key in REQUIRED:
        if key not in m:
            raise PlanFileError(f"{where}: manifest: missing field {key!r}")
    version = c.str(m["fusec_version"], "fusec_version", VERSION_RE)
    if version.split(".")[0] != fusec_version.split(".")[0]:
        raise PlanFileError(f"{where}: manifest: field 'fusec_version' is {_shown(version)}, "
                            f"this is fusec {fusec_version}; recompile the model")
    arch = c.str(m["arch"], "arch", ARCH_RE)
    arch_num = int(ARCH_RE.fullmatch(arch).group(1))  # type: ignore[union-attr]
    c.choice(m["dtype"], "dtype", PLAN_DTYPES)
    for key in ("nvrtc_version", "cupy_version", "driver_version"):
        c.str(m[key], key, VERSION_RE)
    if "model" in m:
        c.str(m["model"], "model")
    if "cuda_graph" in m:
        c.bool(m["cuda_graph"], "cuda_graph")
    if "ab" in m:
        c.obj(m["ab"], "ab")
    if "report" in m:
        _report(c, m["report"], "report")
    for name, rep in c.obj(m.get("reports", {}), "reports").items():
        _report(c, rep, f"reports.{name}")
    src = c.obj(m["source"], "source", SOURCE_KEYS, ("model", "kind", "sha256", "shapes"))
    if src["model"] is not None:
        _base_name(c, src["model"], "source.model")
    c.choice(src["kind"], "source.kind", SOURCE_KINDS)
    if src["sha256"] is not None:
        c.str(src["sha256"], "source.sha256", SHA256_RE)
    for name, dims in c.obj(src["shapes"], "source.shapes").items():
        c.shape(dims, f"source.shapes.{name}")
    for key, v in c.obj(src.get("options", {}), "source.options", SOURCE_OPTIONS).items():
        if key == "fp32_gemm":  # the one mode option
            if not isinstance(v, str) or v not in FP32_GEMM_MODES:
                raise c.fail(f"source.options.{key}", f"{_shown(v)} is not one of {', '.join(FP32_GEMM_MODES)}")
        elif key.startswith("quantize"):  # fusec.compiler.quantize_options: replayed by compile --from-source
            from fusec.quantize import INT4_GROUPS, METHODS

            ok = {"quantize": isinstance(v, str) and v in METHODS,
                  "quantize_group": type(v) is int and v in INT4_GROUPS, "quantize_head": v is True}[key]
            if not ok:
                raise c.fail(f"source.options.{key}", f"{_shown(v)} is not a quantize option fusec records")
        elif isinstance(v, list):
            for i, x in enumerate(v):
                c.str(x, f"source.options.{key}[{i}]", max_len=200)
        elif isinstance(v, Mapping):
            for k, x in v.items():
                if not isinstance(x, (bool, str)):
                    raise c.fail(f"source.options.{key}", f"{_shown(k)} maps to {_kind(x)}, not a boolean or a string")
        else:
            raise c.fail(f"source.options.{key}", f"must be a list or an object, got {_kind(v)}")

    mem = c.obj(m["memory"], "memory", MEMORY_KEYS, ("arena_bytes",))
    for k, v in mem.items():
        c.int(v, f"memory.{k}")
    arena = mem["arena_bytes"]
    wbytes = mem.get("weights_bytes", 0)
    state = mem.get("state_bytes", 0)
    from fusec.shapes import MAX_BYTES_ENV, max_bytes

    for key, n in (("arena_bytes", arena), ("state_bytes", state), ("weights_bytes", wbytes)):
        if n > max_bytes():  # a run-time Tile to 1e12 elements: a 4 TB arena is refused, not allocated
            raise c.fail(f"memory.{key}", f"{n} bytes is more than the limit {max_bytes()} "
                                          f"(set {MAX_BYTES_ENV} to raise it)")
    if wbytes and ("weights" not in blobs or blob_length(blobs, "weights") != wbytes):  # length only: not read here
        raise PlanFileError(f"{where}: weights: expected {wbytes} bytes (field 'memory.weights_bytes')")
    limits = {"arena": arena, "weights": wbytes, "state": state}

    # modules and kernels: every cubin an ELF for this arch, every source self-contained
    mod_entry: dict[str, str] = {}
    for i, mod in enumerate(c.arr(m["modules"], "modules", 100000)):
        f = f"modules[{i}]"
        mod = c.obj(mod, f, MODULE_KEYS, ("id", "cubin", "source", "entry"))
        mid = c.str(mod["id"], f"{f}.id", max_len=200)
        if mid in mod_entry:
            raise c.fail(f"{f}.id", f"module {_shown(mid)} is defined twice")
        entry = c.str(mod["entry"], f"{f}.entry", IDENT_RE)
        if "template" in mod:
            c.str(mod["template"], f"{f}.template", max_len=200)
        for part in ("cubin", "source"):
            name = c.str(mod[part], f"{f}.{part}", max_len=200)
            if name not in blobs:
                raise PlanFileError(f"{where}: module {_shown(mid)}: missing part {_shown(name)}")
        cubin = bytes(blobs[mod["cubin"]][:64])
        got = cubin_arch(cubin)
        if got is None:
            raise PlanFileError(f"{where}: module {_shown(mid)}: part {_shown(mod['cubin'])} is not a CUDA ELF cubin "
                                "(bad header); refusing to load it")
        if got != arch_num:
            raise PlanFileError(f"{where}: module {_shown(mid)}: cubin is for sm_{got}, but field 'arch' is {arch}")
        check_source(blobs[mod["source"]], entry, f"{where}: module {_shown(mid)}: part {_shown(mod['source'])}")
        mod_entry[mid] = entry
    kernels = c.arr(m["kernels"], "kernels", 100000)
    for i, k in enumerate(kernels):
        f = f"kernels[{i}]"
        k = c.obj(k, f, KERNEL_KEYS, ("module", "entry"))
        if c.str(k["module"], f"{f}.module", max_len=200) not in mod_entry:
            raise PlanFileError(f"{where}: kernel #{i}: unknown module {_shown(k['module'])}")
        if c.str(k["entry"], f"{f}.entry", IDENT_RE) != mod_entry[k["module"]]:
            raise c.fail(f"{f}.entry", f"{_shown(k['entry'])} is not the entry of module {_shown(k['module'])}")
        c.int(k.get("smem", 0), f"{f}.smem", 0, MAX_SMEM)

    # state records: inside the state region
    state_names = set()
    for i, rec in enumerate(c.arr(m.get("state", []), "state", 100000)):
        f = f"state[{i}]"
        rec = c.obj(rec, f, {"name", "shape", "dtype", "offset"}, ("name", "shape", "dtype", "offset"))
        name = c.str(rec["name"], f"{f}.name")
        if name in state_names:
            raise c.fail(f"{f}.name", f"state {_shown(name)} is declared twice")
        state_names.add(name)
        nbytes = sig_bytes(c, rec, f)
        off = c.int(rec["offset"], f"{f}.offset")
        try:
            c.span("state", off, nbytes, limits, f"{f}.offset")
        except PlanFileError:
            raise PlanFileError(f"{where}: state {_shown(name)}: offset {off} + {nbytes} bytes lies outside the "
                                f"state region ({state} bytes)") from None

    if "entries" in m:
        if any(k in m for k in ("inputs", "outputs", "launches")):
            raise PlanFileError(f"{where}: manifest: field 'entries' and top-level entry fields are both present")
        ents = m["entries"]
        if not isinstance(ents, Mapping) or not ents:
            raise PlanFileError(f"{where}: manifest: field 'entries' must map entry names to entry points")
        for name, e in ents.items():
            c.str(name, "entries", IDENT_RE)
            c.obj(e, f"entries.{name}", ENTRY_KEYS, ("inputs", "outputs", "launches", "arena_bytes"))
            if c.int(e["arena_bytes"], f"entries.{name}.arena_bytes") > arena:
                raise c.fail(f"entries.{name}.arena_bytes", f"{e['arena_bytes']} is more than memory.arena_bytes ({arena})")
    else:
        for key in ("inputs", "outputs", "launches"):
            if key not in m:
                raise PlanFileError(f"{where}: manifest: missing field {key!r}")
        ents = {"main": m}
    for ename, e in ents.items():
        prefix = f"entries.{ename}." if "entries" in m else ""
        check_entry(c, e, kernels, limits, prefix)
    if "generation" in m:
        _generation(c, m, blobs)


def _base_name(c: FieldCheck, v: Any, field: str) -> str:
    """A built-in model's name or a file's or directory's base name, as ``loader.source_record``
    and ``genmodel`` record a source model (``Path(".").name`` is "", ``Path("..").name`` is "..");
    never a path (``/etc/shadow`` would be hashed, probed and suggested as a model to run)."""
    name = c.str(v, field, max_len=255)
    if not name.isprintable() or "/" in name or "\\" in name:
        raise c.fail(field, f"{_shown(name)} is not a model's name or a file's base name (a plan records "
                            "its source model by name, never by path)")
    return name


def _counts(c: FieldCheck, v: Any, field: str) -> None:
    for k, n in c.obj(v, field).items():
        c.int(n, f"{field}.{k}", 0, 2**62)


def _report(c: FieldCheck, rep: Any, f: str) -> None:
    """The compiler's report is informational, but ``fusec inspect`` prints it and ``fusec
    bench-kernels`` reads its launch bytes: what they read has the types the compiler writes
    (its strings are printed escaped)."""
    rep = c.obj(rep, f)
    if "nodes" in rep:
        c.int(rep["nodes"], f"{f}.nodes", 0, 2**62)
    for key in ("ops", "patterns"):
        if key in rep:
            _counts(c, rep[key], f"{f}.{key}")
    for i, x in enumerate(c.arr(rep.get("fusions", []), f"{f}.fusions", 10**6)):
        x = c.obj(x, f"{f}.fusions[{i}]")
        for key in ("rule", "kind", "decision", "layer", "reason"):
            if x.get(key) is not None:
                c.str(x[key], f"{f}.fusions[{i}].{key}", max_len=1 << 16)
        if x.get("members") is not None:
            c.arr(x["members"], f"{f}.fusions[{i}].members")
    low = c.obj(rep.get("lowering", {}), f"{f}.lowering")
    if "kernels_compiled" in low:
        c.int(low["kernels_compiled"], f"{f}.lowering.kernels_compiled", 0, 2**62)
    if "by_template" in low:
        _counts(c, low["by_template"], f"{f}.lowering.by_template")
    for i, n in enumerate(c.arr(low.get("launch_bytes", []), f"{f}.lowering.launch_bytes")):
        c.int(n, f"{f}.lowering.launch_bytes[{i}]", 0, 2**62)


def _generation(c: FieldCheck, m: Mapping[str, Any], blobs: Mapping[str, Any]) -> None:
    """A generation plan (``fusec.compiler.compile_generation``): its two entry points, and the
    record that ``fusec generate``, ``fusec.runtime.generation`` and ``fusec.report.subject`` read
    (every key typed and in range; the states the runner writes shaped as the record says)."""
    ents = m.get("entries")
    admits = isinstance(m["generation"], Mapping) and "admit_batch" in m["generation"]
    joins = isinstance(m["generation"], Mapping) and "join" in m["generation"]
    want = GEN_ENTRIES + (("admit",) if admits else ()) + (("join",) if joins else ())
    if not isinstance(ents, Mapping) or sorted(ents) != sorted(want):
        got = ", ".join(_shown(k) for k in ents) if isinstance(ents, Mapping) else "none"
        which = " and ".join(w for w, on in (("an admit batch", admits), ("a join entry", joins)) if on)
        raise c.fail("entries", f"a generation plan {f'with {which} ' if which else ''}has the entry points "
                                f"{', '.join(want[:-1])} and {want[-1]}; got {got}")
    if isinstance(m["generation"], Mapping) and "sampling" in m["generation"]:
        raise c.fail("generation.sampling", "this plan compiles its sampling settings in (made by an older fusec); "
                                            "plans now keep them as per-row state: recompile it")
    g = c.obj(m["generation"], "generation", GEN_KEYS, GEN_REQUIRED)
    c.choice(g["entry"], "generation.entry", GEN_ENTRIES)
    i31 = 2**31 - 1
    batch = c.int(g["batch"], "generation.batch", 1, i31)
    t_max = c.int(g["max_seq_len"], "generation.max_seq_len", 1, MAX_DIM)
    if admits:
        c.int(g["admit_batch"], "generation.admit_batch", 1, batch - 1)
    if joins:  # true: one prompt a step (as fusec before 2026-11-28 wrote it)
        slots = 1 if g["join"] is True else c.int(g["join"], "generation.join", 1, batch)
        entry = ents["join"] if isinstance(ents["join"], Mapping) else {}
        inputs = entry.get("inputs") if isinstance(entry.get("inputs"), list) else []
        rows = [d.get("shape") for d in inputs if isinstance(d, Mapping) and d.get("name") == "row"]
        if rows != [[slots]]:
            raise c.fail("generation.join", f"{slots} prompts a step, but the join entry's input 'row' is "
                                            f"{rows[0] if rows else 'missing'}")
    c.int(g["prefill_len"], "generation.prefill_len", 1, t_max)
    c.int(g["vocab_size"], "generation.vocab_size", 1, i31)
    c.int(g["num_layers"], "generation.num_layers", 0, i31)
    for i, e in enumerate(c.arr(g["eos_ids"], "generation.eos_ids", 4096)):
        c.int(e, f"generation.eos_ids[{i}]", 0, i31)
    _base_name(c, g["source"], "generation.source")
    if "tokenizer" in g:
        t = c.obj(g["tokenizer"], "generation.tokenizer", TOKENIZER_KEYS)
        if t.get("bos_id") is not None:
            c.int(t["bos_id"], "generation.tokenizer.bos_id", 0, i31)
        for i, e in enumerate(c.arr(t.get("eos_ids") or [], "generation.tokenizer.eos_ids", 4096)):
            c.int(e, f"generation.tokenizer.eos_ids[{i}]", 0, i31)
        if t.get("add_bos") is not None:
            c.bool(t["add_bos"], "generation.tokenizer.add_bos")
        if t.get("chat_template") is not None:
            c.str(t["chat_template"], "generation.tokenizer.chat_template", max_len=MAX_CHAT_TEMPLATE)
        if "tokenizer" not in blobs:
            raise PlanFileError(f"{c.where}: missing part 'tokenizer' (field 'generation.tokenizer')")
    states = {r["name"]: r for r in m.get("state", [])}
    for name, dtype, shape in (("pos", "i64", [batch]), ("done", "bool", [batch]), ("seed", "i64", [batch]),
                               ("temperature", "f32", [batch]), ("top_k", "i64", [batch]), ("top_p", "f32", [batch]),
                               ("tokens", "i64", [batch, t_max])):
        r = states.get(name)
        if r is None or r["dtype"] != dtype or list(r["shape"]) != shape:
            got = "none" if r is None else f"{r['dtype']}{list(r['shape'])}"
            raise c.fail("state", f"a generation plan's state {name!r} must be {dtype}{shape} (generation.batch "
                                  f"{batch}, generation.max_seq_len {t_max}); got {got}")
