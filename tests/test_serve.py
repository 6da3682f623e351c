"""``fusec serve`` on the CPU: the real server (a subprocess, reference backend) on 127.0.0.1 with an
ephemeral port, a tiny Llama checkpoint with a byte-level tokenizer and a chat template. The official
``openai`` client in all four modes, concurrency, disconnects, stop strings, seeds, hostile requests
and SIGTERM mid-stream. Every request loop is bounded in count and time."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
pytest.importorskip("safetensors")

KEY = "test-key-123"
MODEL = "tinyllama"
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def _checkpoint(d: Path) -> Path:
    from safetensors.numpy import save_file
    from test_hf_dir_hostile import CONFIG, _tensors, _tokenizer_json

    d.mkdir()
    save_file(_tensors(), str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps(dict(CONFIG, max_position_embeddings=512)))
    (d / "tokenizer.json").write_text(_tokenizer_json())
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                         "chat_template": TEMPLATE}))
    return d


class Served:
    def __init__(self, proc: subprocess.Popen, port: int, err: Path):
        self.proc, self.port, self.err = proc, port, err
        self.base = f"http://127.0.0.1:{port}"

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, max_retries=0, timeout=60)

    def post(self, path: str, body: object, key: str = KEY, raw: bytes | None = None, headers=None) -> httpx.Response:
        h = {"Authorization": f"Bearer {key}", "Content-Type": "application/json", **(headers or {})}
        data = raw if raw is not None else json.dumps(body).encode()
        return httpx.post(self.base + path, content=data, headers=h, timeout=60)

    def health(self) -> dict:
        return httpx.get(self.base + "/health", timeout=10).json()


def _start(model_dir: Path, err: Path, *extra: str) -> Served:
    env = dict(os.environ, PYTHONUNBUFFERED="1", FUSEC_CACHE_DIR=str(err.parent / "kernel-cache"))
    cmd = [sys.executable, "-m", "fusec", "serve", str(model_dir), "--port", "0", "--batch", "4", "--max-seq-len",
           "512", "--max-prompt-len", "64", "--served-model-name", MODEL, "--api-key", KEY, "--max-queue", "8",
           "--max-body-bytes", "65536", "--admit-batch", "2", "--join", *extra]
    f = open(err, "wb")  # noqa: SIM115 - the server's stderr, read by the tests
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=f, env=env)
    t_end = time.monotonic() + 90
    while time.monotonic() < t_end:
        text = err.read_text(errors="replace")
        if "http://" in text:
            port = int(text.split("http://127.0.0.1:")[1].split(" ")[0])
            return Served(proc, port, err)
        if proc.poll() is not None:
            raise AssertionError(f"the server exited: {text}")
        time.sleep(0.1)
    proc.kill()
    raise AssertionError("the server did not start in 90 s")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    d = tmp_path_factory.mktemp("serve")
    model = _checkpoint(d / "model")
    s = _start(model, d / "server.err")
    yield s
    s.proc.send_signal(signal.SIGINT)
    try:
        s.proc.wait(30)
    except subprocess.TimeoutExpired:
        s.proc.kill()


@pytest.fixture(scope="module")
def model_dir(served) -> Path:
    return Path(served.proc.args[4])


def _complete(client, prompt, n, **kw) -> tuple[str, str, object]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage


# ---- the official client, four modes --------------------------------------------------------------

def test_openai_client_all_four_modes(served):
    c = served.client()
    assert [m.id for m in c.models.list().data] == [MODEL]
    text, finish, use = _complete(c, "Hello, wörld", 12)
    assert finish in ("length", "stop") and use.prompt_tokens == len("Hello, wörld".encode()) and use.completion_tokens >= 1
    pieces = [ch.choices[0].text for ch in c.completions.create(model=MODEL, prompt="Hello, wörld", max_tokens=12,
                                                                temperature=0, stream=True)]
    assert "".join(pieces) == text  # streamed text is exactly the final text
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hi ✓"}]
    chat = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    want = chat.choices[0].message.content
    stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == want
    assert chunks[-1].usage.completion_tokens == chat.usage.completion_tokens
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == chat.choices[0].finish_reason
    # the chat template rendered the messages: the same prompt as a completion draws the same text
    rendered = "<system>be brief\n<user>Hi ✓\n<assistant>"
    assert _complete(c, rendered, 10)[0] == want


def test_sse_ends_with_done_and_streams_exactly_the_final_text(served):
    body = {"model": MODEL, "prompt": "ü€😀 " * 3, "max_tokens": 40, "temperature": 0}
    final = served.post("/v1/completions", body).json()["choices"][0]["text"]
    with httpx.stream("POST", served.base + "/v1/completions", json=dict(body, stream=True), timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]" and all(x.startswith("data: ") for x in lines)
    assert "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[:-1]) == final


def test_text_pieces_hold_whole_characters_and_stop_strings_are_held_back():
    from test_hf_dir_hostile import _tokenizer_json
    from tokenizers import Tokenizer as HFTok

    from fusec.serve.text import TextStream
    from fusec.text import Tokenizer

    tok = Tokenizer(HFTok.from_str(_tokenizer_json()), bos_id=None, eos_ids=(), add_bos=False)
    text = "aü€😀b STOP c"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte: characters span tokens
    ts = TextStream(tok)
    pieces = [ts.add([t]) for t in ids] + [ts.add([], final=True)]
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)
    ts = TextStream(tok, stop=["STOP"])
    pieces = [ts.add([t]) for t in ids]
    assert "".join(pieces) == "aü€😀b " and ts.stopped
    assert "S" not in "".join(pieces[:ids.index(tok.encode("S")[0]) + 3])  # "ST" waited: it could become STOP
    ts = TextStream(None)
    assert "".join(ts.add(x) for x in ([5], [6, 7])) == "5 6 7"  # no tokenizer: the ids


def test_streamed_text_decoded_in_windows_equals_the_whole_decode():
    """TextStream decodes a moving window, not the whole sequence, at each step: over random
    texts of multi-byte characters fed in random chunks, the pieces join to the tokenizer's decode
    of all the ids, and no piece holds a broken character."""
    from test_hf_dir_hostile import _tokenizer_json
    from tokenizers import Tokenizer as HFTok

    from fusec.serve.text import TextStream
    from fusec.text import Tokenizer

    tok = Tokenizer(HFTok.from_str(_tokenizer_json()), bos_id=None, eos_ids=(), add_bos=False)
    rng = np.random.default_rng(5)
    alphabet = list("ab Zü€😀 ,.") + ["\n"]
    for _ in range(40):
        ids = tok.encode("".join(rng.choice(alphabet, int(rng.integers(1, 40)))))
        ts, pieces, at = TextStream(tok), [], 0
        while at < len(ids):
            n = int(rng.integers(1, 4))
            pieces.append(ts.add(ids[at:at + n]))
            at += n
        pieces.append(ts.add([], final=True))
        assert "".join(pieces) == tok.decode(ids)
        assert all("\ufffd" not in p for p in pieces[:-1])
    ts = TextStream(None)
    got = "".join(ts.add(list(range(i, i + 3))) for i in range(0, 30, 3))
    assert got == " ".join(map(str, range(30)))


# ---- batching ------------------------------------------------------------------------------------

async def _many(served, bodies):
    async with httpx.AsyncClient(base_url=served.base, timeout=120,
                                 headers={"Authorization": f"Bearer {KEY}"}) as ac:
        return await asyncio.gather(*(ac.post("/v1/completions", json=b) for b in bodies))


def test_concurrent_greedy_requests_equal_each_alone(served):
    prompts = ["The cat", "A dog and", "x", "Lorem ipsum dolor", "12345", "hello there, general", "zz"]
    bodies = [{"model": MODEL, "prompt": p, "max_tokens": 8 + 3 * i, "temperature": 0} for i, p in enumerate(prompts)]
    alone = [served.post("/v1/completions", b).json()["choices"][0]["text"] for b in bodies]
    together = asyncio.run(_many(served, bodies))  # 7 requests through 4 rows: some wait, join later
    assert [r.status_code for r in together] == [200] * len(bodies)
    assert [r.json()["choices"][0]["text"] for r in together] == alone
    # an idle server admits through the admit entry (two prompts a run; three or four at once: the
    # prefill), a busy one through the join entry (a request rides in the next decode step)
    h = served.health()
    assert h["admit_runs"] > 0 and h["joins"] > 0


def test_disconnect_mid_stream_frees_the_row(served):
    before = served.health()
    body = {"model": MODEL, "prompt": "tell me", "max_tokens": 400, "temperature": 0.7, "seed": 1, "stream": True}
    with httpx.stream("POST", served.base + "/v1/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as r:
        next(r.iter_lines())  # the first event, then hang up
    t_end = time.monotonic() + 20
    while time.monotonic() < t_end:
        h = served.health()
        if h["rows_in_use"] == 0 and h["cancelled"] > before["cancelled"]:
            break
        time.sleep(0.05)
    assert h["rows_in_use"] == 0 and h["cancelled"] == before["cancelled"] + 1, h
    assert served.post("/v1/completions", {"model": MODEL, "prompt": "next", "max_tokens": 3}).status_code == 200


def test_stop_strings_end_the_text_before_them(served):
    c = served.client()
    full, _, _ = _complete(c, "stop here", 30)
    cut = full[4:7]
    assert cut and cut in full
    want = full[:full.index(cut)]
    text, finish, _ = _complete(c, "stop here", 30, stop=[cut, "never-there"])
    assert (text, finish) == (want, "stop")
    streamed = [ch.choices[0] for ch in c.completions.create(model=MODEL, prompt="stop here", max_tokens=30,
                                                              temperature=0, stop=cut, stream=True)]
    assert "".join(ch.text for ch in streamed) == want and streamed[-1].finish_reason == "stop"


def test_sampling_is_reproducible_by_seed_and_row(served):
    def draw(seed, **kw):
        body = {"model": MODEL, "prompt": "seeded", "max_tokens": 16, "temperature": 0.9, "top_p": 0.95,
                "top_k": 50, "seed": seed, **kw}
        return served.post("/v1/completions", body).json()["choices"][0]["text"]

    a = draw(7)
    assert draw(7) == a and draw(8) != a
    # the same request beside others (another row, other settings) draws the same text
    others = [{"model": MODEL, "prompt": "other", "max_tokens": 20, "temperature": 0}] * 3
    mixed = asyncio.run(_many(served, others + [{"model": MODEL, "prompt": "seeded", "max_tokens": 16,
                                                 "temperature": 0.9, "top_p": 0.95, "top_k": 50, "seed": 7}]))
    assert mixed[-1].json()["choices"][0]["text"] == a


# ---- hostile requests -----------------------------------------------------------------------------

HOSTILE = [
    ("malformed JSON", None, b'{"model": "tinyllama", "prompt": ', 400),
    ("not UTF-8", None, b'{"model": "tinyllama", "prompt": "\xff\xfe"}', 400),
    ("not an object", [1, 2], None, 400),
    ("negative max_tokens", {"model": MODEL, "prompt": "a", "max_tokens": -5}, None, 400),
    ("huge max_tokens", {"model": MODEL, "prompt": "a", "max_tokens": 10**30}, None, 400),
    ("max_tokens past the context", {"model": MODEL, "prompt": "a", "max_tokens": 512}, None, 400),
    ("unknown field", {"model": MODEL, "prompt": "a", "bogus": 1}, None, 400),
    ("unsupported field", {"model": MODEL, "prompt": "a", "n": 3}, None, 400),
    ("unknown model", {"model": "gpt-4", "prompt": "a"}, None, 404),
    ("no model", {"prompt": "a"}, None, 400),
    ("temperature NaN", None, b'{"model": "tinyllama", "prompt": "a", "temperature": NaN}', 400),
    ("top_p zero", {"model": MODEL, "prompt": "a", "top_p": 0}, None, 400),
    ("prompt too long", {"model": MODEL, "prompt": "y" * 65}, None, 400),
    ("token id outside", {"model": MODEL, "prompt": [1, 2, 9999]}, None, 400),
    ("deep JSON", None, b"[" * 30000 + b"]" * 30000, 400),
    ("ten MB body", None, b'{"prompt": "' + b"a" * (10 << 20) + b'"}', 413),
]


@pytest.mark.parametrize("name,body,raw,status", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_requests_get_an_error_object(served, name, body, raw, status):
    r = served.post("/v1/completions", body, raw=raw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["type"] and "Traceback" not in r.text


def test_keys_paths_and_methods(served):
    assert served.post("/v1/completions", {"model": MODEL, "prompt": "a"}, key="wrong").status_code == 401
    assert httpx.get(served.base + "/v1/models", timeout=10).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        served.client(key="nope").models.list()
    assert httpx.get(served.base + "/v2/anything", timeout=10).status_code == 404
    assert httpx.get(served.base + "/v1/completions", timeout=10, headers={"Authorization": f"Bearer {KEY}"}
                     ).status_code == 405
    m = httpx.get(served.base + "/metrics", timeout=10).text
    assert "fusec_requests_total" in m and "fusec_batch_rows 4.0" in m and "fusec_queue_length" in m


def test_a_burst_of_1000_requests_is_served_or_refused_and_the_server_goes_on(served):
    async def burst():
        limits = httpx.Limits(max_connections=32)  # 32 in flight: more than 4 rows + 8 queued
        async with httpx.AsyncClient(base_url=served.base, timeout=120, limits=limits,
                                     headers={"Authorization": f"Bearer {KEY}"}) as ac:
            body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 2, "temperature": 0}
            return await asyncio.gather(*(ac.post("/v1/completions", json=body) for _ in range(1000)))

    t0 = time.monotonic()
    rs = asyncio.run(burst())
    codes = [r.status_code for r in rs]
    assert set(codes) <= {200, 503} and codes.count(200) >= 12, {c: codes.count(c) for c in set(codes)}
    busy = next(r for r in rs if r.status_code == 503) if 503 in codes else None
    if busy is not None:
        assert busy.json()["error"]["code"] == "server_overloaded"
    assert time.monotonic() - t0 < 120
    assert served.health()["status"] == "ok"
    assert served.post("/v1/completions", {"model": MODEL, "prompt": "after", "max_tokens": 2}).status_code == 200


def test_the_start_line_says_how_requests_are_admitted(served):
    first = served.err.read_text(errors="replace").split("http://127.0.0.1:")[1].splitlines()[0]
    assert "admits through the admit entry (2 a run) or the prefill; while rows decode, through the join entry" in first


def test_access_log_has_one_line_per_request(served):
    served.post("/v1/completions", {"model": MODEL, "prompt": "logged", "max_tokens": 3, "temperature": 0})
    lines = [x for x in served.err.read_text(errors="replace").splitlines() if x.startswith("POST /v1/completions 200")]
    assert lines and all("prompt_tokens=" in x and "ttft_ms=" in x and "tok_s=" in x for x in lines)
    assert "Traceback" not in served.err.read_text(errors="replace")


# ---- shutdown -------------------------------------------------------------------------------------

def test_sigterm_mid_stream_ends_the_stream_with_an_error_and_exits(model_dir, tmp_path):
    s = _start(model_dir, tmp_path / "server.err")
    try:
        body = {"model": MODEL, "prompt": "long", "max_tokens": 400, "temperature": 0.8, "seed": 3, "stream": True}
        lines = []
        with httpx.stream("POST", s.base + "/v1/completions", json=body, timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            it = r.iter_lines()
            lines.append(next(it))
            s.proc.send_signal(signal.SIGTERM)
            lines += [x for x in it if x]
        assert lines[-1] == "data: [DONE]"
        assert "error" in json.loads(lines[-2][6:]), lines[-3:]
        assert s.proc.wait(30) == 0
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    err = s.err.read_text(errors="replace")
    assert "Traceback" not in err and "stopped" in err
