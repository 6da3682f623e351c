"""Load benchmark of ``fusec serve``: N concurrent streaming clients against a Qwen3-0.6B-shaped plan.

    python benchmarks/serve.py OUT_DIR                      # GPU: clients 1, 8, 32 (about 3-4 minutes on an H100)
    python benchmarks/serve.py OUT_DIR --cpu-check          # llama-tiny on the reference backend: the plumbing

For each N: a generation plan of batch N (qwen3-0.6b, random weights, bf16, no end-of-sequence
token, prompts of --prompt-len tokens, --max-tokens new ones), first timed as ``plan.generate`` on
N prompts (the plan's own throughput at that batch: decode tok/s, and end to end with the prefill),
then saved and served by ``fusec serve PLAN`` in a subprocess on 127.0.0.1 (an ephemeral port;
nothing but loopback). N clients (threads of the standard library's http.client, so no client
package is needed, each keeping its connection alive, spread over up to 8 processes so that they
do not queue for one interpreter lock) each send streaming completions back to back for --duration seconds (greedy, random
prompt ids) and time every server-sent event. Reported per N: total tok/s (tokens received over
the window), steady tok/s (those received while every client had a request in flight: from the
window's first second to the deadline, no start-up, no drain), time to first token p50/p99 (request sent -> first text), inter-token latency p50/p99
(gap between events / tokens in the event), requests, the server's own counters (/health), and the
ratio to the plan's generate rate. Writes OUT_DIR/serve.json and OUT_DIR/serve.md.

Needs on the GPU machine: fusec with its cuda extra, and the serve extra's wheels (starlette,
uvicorn, prometheus_client and their dependencies).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
from fusec.runtime.generation import generate_with_plan
from fusec.cli.serve import join_prompts
from fusec.serve.batcher import READBACK_EVERY

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(xs), q)) if xs else None


# ---- the plan's own rate --------------------------------------------------------------------------

def _admit_batch(args: argparse.Namespace, n: int) -> int:
    """The plan's admit batch (fusec serve --admit-batch): n // --admit-div (0 / below 4 clients: none)."""
    return n // args.admit_div if args.admit_div and n >= 4 else 0


def baseline(args: argparse.Namespace, gm: Any, n: int, prompts: list[list[int]], out_dir: str,
             cuda: bool) -> tuple[dict[str, Any], str | None]:
    """plan.generate at batch n (twice: the first run captures the CUDA graph); the plan's path."""
    from fusec.compiler import compile_generation
    from fusec.generation import ReferenceEngine, generate
    from fusec.genmodel import build_graphs

    t_max = args.prompt_len + args.max_tokens
    t0 = time.perf_counter()
    if not cuda:
        engine = ReferenceEngine(build_graphs(gm, n, t_max, args.prompt_len, eos_ids=(), admit_batch=_admit_batch(args, n),
                                              join=join_prompts(args.join, gm, n)), optimize=True)
        res = generate(engine, prompts[:n], args.max_tokens, gm.config.vocab_size)
        total = res.prefill_ms / 1e3 + res.decode_ms / 1e3
        return {"decode_tok_s": res.decode_tok_s, "prefill_ms": res.prefill_ms,
                "end_to_end_tok_s": n * args.max_tokens / total, "compile_s": 0.0}, None
    plan = compile_generation(gm, batch=n, max_seq_len=t_max, prefill_len=args.prompt_len, dtype="bf16", eos_ids=(),
                              admit_batch=_admit_batch(args, n), join=join_prompts(args.join, gm, n))
    compile_s = time.perf_counter() - t0
    path = os.path.join(out_dir, f"qwen3-0.6b-b{n}.fplan")
    plan.save(path)
    runs = []
    for _ in range(2):
        t1 = time.perf_counter()
        res = generate_with_plan(plan, prompts[:n], max_new_tokens=args.max_tokens)
        runs.append((time.perf_counter() - t1, res))
    wall, res = runs[-1]
    costs = entry_costs(plan._engine, n, prompts, args.prompt_len)
    plan._engine = None
    del plan
    return {"decode_tok_s": res.decode_tok_s, "prefill_ms": res.prefill_ms,
            "end_to_end_tok_s": n * args.max_tokens / wall, "compile_s": compile_s,
            "decode_per_step": res.stats.get("decode", {}).get("per_step"), **costs}, path


def entry_costs(engine: Any, n: int, prompts: list[list[int]], prompt_len: int, reps: int = 5) -> dict[str, float]:
    """GPU time (CUDA events, mean of ``reps``) of what an admission runs: the whole-batch prefill,
    and one run of the admit entry when the plan has one."""
    import cupy

    from fusec.generation import admit_feeds

    ids = np.asarray([p[:prompt_len] for p in prompts[:n]], np.int64)
    lengths = np.full(n, prompt_len, np.int64)
    a, b = cupy.cuda.Event(), cupy.cuda.Event()

    def timed(fn: Any) -> float:
        fn()  # warm
        a.record(engine.stream)
        for _ in range(reps):
            fn()
        b.record(engine.stream)
        b.synchronize()
        return float(cupy.cuda.get_elapsed_time(a, b)) / reps

    out = {"prefill_gpu_ms": timed(lambda: engine.prefill(ids, lengths, timed=False))}
    slots = int(engine.meta.get("admit_batch") or 0)
    if slots:
        one = np.zeros(n, np.int64)
        one[:slots] = prompt_len
        feeds = admit_feeds(ids, one, slots)[0]
        out["admit_run_gpu_ms"] = timed(lambda: engine.admit(feeds))
    return out


# ---- the server and its clients ---------------------------------------------------------------------

def start_server(target: str, n: int, args: argparse.Namespace, err_path: str) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "fusec", "serve", target, "--port", "0", "--served-model-name", "bench",
           "--max-queue", str(4 * n + 8)]
    if not target.endswith(".fplan"):  # the reference backend: the model itself
        cmd += ["--batch", str(n), "--max-seq-len", str(args.prompt_len + args.max_tokens), "--max-prompt-len",
                str(args.prompt_len), "--admit-batch", str(_admit_batch(args, n))]
        cmd += ["--join", str(args.join)] if args.join is not None else []  # else fusec serve's default
    cmd += ["--readback-every", str(args.readback_every)]
    err = open(err_path, "wb")  # noqa: SIM115 - the server's log, kept in OUT_DIR
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    t_end = time.monotonic() + 300
    while time.monotonic() < t_end:
        text = open(err_path, errors="replace").read()
        if "http://127.0.0.1:" in text:
            return proc, int(text.split("http://127.0.0.1:")[1].split(" ")[0])
        if proc.poll() is not None:
            raise RuntimeError(f"fusec serve exited: {text[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("fusec serve did not start in 300 s")


def one_request(port: int, prompt: list[int], max_tokens: int,
                conn: http.client.HTTPConnection | None = None) -> dict[str, Any]:
    """One streaming completion; the arrival time and token count of every event. ``conn``: a
    connection kept alive across requests (as client libraries pool theirs); else one of its own."""
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    own = conn is None
    if conn is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    t_send = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            return {"status": resp.status, "t_send": t_send, "events": [], "error": resp.read()[:300].decode()}
        events: list[tuple[float, int]] = []
        while True:
            line = resp.readline()
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                resp.read()  # the rest of the body (its end): the connection is ready for the next request
                break
            obj = json.loads(line[6:])
            if "error" in obj:
                return {"status": 500, "t_send": t_send, "events": events, "error": obj["error"]["message"]}
            text = obj["choices"][0]["text"] if obj.get("choices") else ""
            if text:
                events.append((time.perf_counter(), len(text.split())))  # no tokenizer: the ids, space-separated
        return {"status": 200, "t_send": t_send, "t_end": time.perf_counter(), "events": events}
    except (OSError, http.client.HTTPException):
        conn.close()  # a kept connection the server closed: the next request opens a new one
        if own:
            raise
        return {"status": 0, "t_send": t_send, "events": [], "error": "connection closed"}
    finally:
        if own:
            conn.close()


def _clients(port: int, seeds: list[int], args: dict[str, Any], deadline: float) -> list[list[dict[str, Any]]]:
    """One process's clients (a thread each): streaming completions back to back until ``deadline``
    (``time.perf_counter``, the same clock in every process of the machine)."""
    results: list[list[dict[str, Any]]] = [[] for _ in seeds]

    def client(i: int) -> None:
        r = np.random.default_rng(seeds[i])
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)  # kept alive, as client libraries do
        while time.perf_counter() < deadline:
            prompt = r.integers(1, args["vocab"], args["prompt_len"]).tolist()
            results[i].append(one_request(port, prompt, args["max_tokens"], conn))
        conn.close()

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(seeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.perf_counter()) + 300)
    return results


def load(port: int, n: int, args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """n clients spread over several processes (each parses its streams under its own interpreter
    lock: 32 client threads in one process measured their own lock waits, not the server)."""
    import concurrent.futures
    import multiprocessing

    rng = np.random.default_rng(1234)
    seeds = [int(x) for x in rng.integers(0, 2**31, n)]
    procs = max(1, min(n, args.client_procs or max(1, (os.cpu_count() or 2) // 2), 8))
    groups = [seeds[i::procs] for i in range(procs)]
    opts = {"vocab": vocab, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens}
    with concurrent.futures.ProcessPoolExecutor(procs, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(time.sleep, [0.0] * procs))  # the processes started and imported before the clock starts
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        parts = list(pool.map(_clients, [port] * procs, groups, [opts] * procs, [deadline] * procs))
        t1 = time.perf_counter()
    reqs = [r for part in parts for rs in part for r in rs]
    ok = [r for r in reqs if r["status"] == 200 and r["events"]]
    tokens = sum(k for r in ok for _, k in r["events"])
    # the steady window: every client has a request in flight from its first second to the deadline
    w0 = t0 + min(1.0, args.duration / 4)
    steady = sum(k for r in ok for t, k in r["events"] if w0 <= t < deadline) / (deadline - w0)
    ttft = [(r["events"][0][0] - r["t_send"]) * 1e3 for r in ok]
    itl = [(b[0] - a[0]) * 1e3 / b[1] for r in ok for a, b in zip(r["events"], r["events"][1:])]
    per_event = [k for r in ok for _, k in r["events"]]
    return {"clients": n, "client_processes": procs, "window_s": t1 - t0, "requests": len(reqs), "ok": len(ok),
            "errors": sorted({str(r.get("error"))[:200] for r in reqs if r["status"] != 200})[:5],
            "tokens": tokens, "tok_s": tokens / (t1 - t0), "steady_tok_s": steady,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "itl_ms_p50": pct(itl, 50), "itl_ms_p99": pct(itl, 99), "tokens_per_event_mean": float(np.mean(per_event))
            if per_event else None}


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of process ``pid`` (Linux /proc; {} elsewhere)."""
    out: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            continue
    return out


def cpu_use(before: dict[int, float], after: dict[int, float], seconds: float) -> dict[str, Any]:
    """The server's CPU over the window: cores in all, and its three busiest threads' share of one core."""
    used = sorted(((after[t] - before.get(t, 0.0)) / seconds for t in after), reverse=True)
    return {"cores": sum(used), "top_threads": [round(u, 2) for u in used[:3]]}


def health(port: int) -> dict[str, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/health")
        return json.loads(conn.getresponse().read())
    finally:
        conn.close()


def stop(proc: subprocess.Popen) -> int | None:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        return None


# ---- report ------------------------------------------------------------------------------------------

def markdown(doc: dict[str, Any]) -> str:
    a = doc["args"]
    lines = [f"### fusec serve under load ({doc['device']}, {doc['model']}, prompts {a['prompt_len']} tokens, "
             f"{a['max_tokens']} new, {a['duration']} s per point)", "",
             "| clients (= plan batch) | total tok/s | steady tok/s | plan generate decode tok/s | ratio | steady ratio "
             "| generate end-to-end tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | tokens per event | requests "
             "| admissions (admit-entry runs) [joins: requests] |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def f(x: Any, d: int = 1) -> str:
        return "-" if x is None else f"{x:.{d}f}"

    for r in doc["points"]:
        s, b, h = r["serve"], r["generate"], r.get("server", {})
        ratio = s["tok_s"] / b["decode_tok_s"] if b.get("decode_tok_s") else None
        steady = s.get("steady_tok_s")
        steady_ratio = steady / b["decode_tok_s"] if steady is not None and b.get("decode_tok_s") else None
        lines.append(f"| {r['clients']} | {f(s['tok_s'])} | {f(steady)} | {f(b.get('decode_tok_s'))} | {f(ratio, 2)} | "
                     f"{f(steady_ratio, 2)} | "
                     f"{f(b.get('end_to_end_tok_s'))} | {f(s['ttft_ms_p50'])} / {f(s['ttft_ms_p99'])} | "
                     f"{f(s['itl_ms_p50'], 2)} / {f(s['itl_ms_p99'], 2)} | {f(s['tokens_per_event_mean'], 2)} | "
                     f"{s['ok']}/{s['requests']} | {h.get('admissions', '-')} ({h.get('admit_runs', '-')}) [{h.get('joins', '-')}: {h.get('joined', '-')}] |")
    lines += ["", "Where the time goes (the server's counters, /health; the entries' GPU time in the generate process):",
              "", "| clients | rows in use per decode step | decode steps | admissions | host synchronizations in admissions "
              "| mean host work of an admission or join ms | whole-batch prefill GPU ms | one admit run GPU ms "
              "| server GPU ms per decode / join step | server runs queued to an idle GPU "
              "| server CPU cores (busiest threads) | HTTP stack |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in doc["points"]:
        b, h = r["generate"], r.get("server", {})
        steps, adm = h.get("decode_steps") or 0, (h.get("admissions") or 0) + (h.get("joins") or 0)
        gpu = (h.get("gpu") or {}).get("gpu_ms_per_run") or {}
        lines.append(f"| {r['clients']} | {f(h['row_steps'] / steps if steps and 'row_steps' in h else None, 2)} | "
                     f"{steps} | {h.get('admissions', '-')} | {h.get('admit_syncs', '-')} | "
                     f"{f(h['admit_host_ms'] / adm if adm and 'admit_host_ms' in h else None, 2)} | "
                     f"{f(b.get('prefill_gpu_ms'), 2)} | {f(b.get('admit_run_gpu_ms'), 2)} | "
                     f"{f(gpu.get('decode'), 3)} / {f(gpu.get('join'), 3)} | "
                     f"{(h.get('gpu') or {}).get('starved_runs', '-')} of {sum(((h.get('gpu') or {}).get('runs') or {}).values())} | "
                     f"{f(r['serve'].get('server_cpu', {}).get('cores'), 2)} "
                     f"({r['serve'].get('server_cpu', {}).get('top_threads', '-')}) | {doc.get('http_stack', '-')} |")
    lines += ["", "total tok/s: completion tokens received by all clients over the window (from the first request "
              "to the last one's end, after the deadline); steady tok/s: tokens whose events arrived between "
              "the window's first second and the deadline, while every client had a request in flight; TTFT: request sent -> "
              "first text event; ITL: gap between events / tokens in the event. Targets (issue 24): 32 clients >= "
              "0.8 x the plan's batch-32 generate decode rate; TTFT p99 < 4 x p50 at 8 clients."]
    return "\n".join(lines) + "\n"


def http_stack() -> str:
    """What uvicorn runs on here: its C-accelerated HTTP parser and event loop when installed."""
    import importlib.util

    fast = [m for m in ("httptools", "uvloop") if importlib.util.find_spec(m) is not None]
    return " + ".join(fast) if fast else "h11 + asyncio"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir")
    ap.add_argument("--clients", default="1,8,32")
    ap.add_argument("--admit-div", type=int, default=0, metavar="D", help="plans with an admit entry of batch / D "
                    "prompts a run (fusec serve --admit-batch; 0: none, every admission prefills the whole batch)")
    ap.add_argument("--join", type=int, default=None, metavar="J", help="plans with a join entry of J prompts a step "
                    "(fusec serve --join J): requests admitted while rows decode ride in a decode step (0: none; "
                    "default: fusec serve's)")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds of load per point")
    ap.add_argument("--readback-every", type=int, default=READBACK_EVERY, metavar="K",
                    help="the server reads the drawn tokens back every K decode steps (fusec serve --readback-every)")
    ap.add_argument("--client-procs", type=int, default=0, metavar="P",
                    help="processes the clients are spread over (default: half the cores, at most 8)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cpu-check", action="store_true", help="llama-tiny on the reference backend (no GPU)")
    args = ap.parse_args()
    if args.cpu_check:
        args.clients, args.duration = "1,4", min(args.duration, 4.0)
        args.prompt_len, args.max_tokens = min(args.prompt_len, 16), min(args.max_tokens, 16)
    os.makedirs(args.out_dir, exist_ok=True)
    from fusec.genmodel import load_generation_model

    cuda = not args.cpu_check
    name = "llama-tiny" if args.cpu_check else "qwen3-0.6b"
    gm = load_generation_model(name)
    vocab = gm.config.vocab_size
    counts = [int(c) for c in args.clients.split(",")]
    rng = np.random.default_rng(7)
    prompts = [rng.integers(1, vocab, args.prompt_len).tolist() for _ in range(max(counts))]
    device = "CPU (reference backend)"
    if cuda:
        import cupy

        device = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    doc: dict[str, Any] = {"http_stack": http_stack(), "device": device, "model": f"{name} (random weights, bf16)" if cuda else name,
                           "args": vars(args), "points": []}
    for n in counts:
        log(f"clients {n}: plan of batch {n}")
        gen, path = baseline(args, gm, n, prompts, args.out_dir, cuda)
        log(f"  generate: decode {gen['decode_tok_s']:.0f} tok/s, end to end {gen['end_to_end_tok_s']:.0f} tok/s "
            f"(compile {gen['compile_s']:.1f} s)")
        err = os.path.join(args.out_dir, f"server-b{n}.log")
        proc, port = start_server(path or name, n, args, err)
        try:
            one_request(port, prompts[0], 4)  # warm-up: the decode step's CUDA graph is captured here
            log(f"  serving on port {port}: {n} clients for {args.duration:.0f} s")
            cpu0, t0 = thread_cpu(proc.pid), time.perf_counter()
            s = load(port, n, args, vocab)
            s["server_cpu"] = cpu_use(cpu0, thread_cpu(proc.pid), time.perf_counter() - t0)
            server = health(port)
        finally:
            code = stop(proc)
        log(f"  serve: {s['tok_s']:.0f} tok/s, TTFT p50 {s['ttft_ms_p50']} ms p99 {s['ttft_ms_p99']} ms, "
            f"ITL p50 {s['itl_ms_p50']} ms, {s['ok']}/{s['requests']} requests; server exit {code}")
        doc["points"].append({"clients": n, "generate": gen, "serve": s, "server": server, "server_exit": code})
        with open(os.path.join(args.out_dir, "serve.json"), "w") as f:
            json.dump(doc, f, indent=1, default=str)
    md = markdown(doc)
    with open(os.path.join(args.out_dir, "serve.md"), "w") as f:
        f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
