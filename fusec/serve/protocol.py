"""The OpenAI API as ``fusec serve`` speaks it: request fields, their checks, response objects.

``parse_completion`` / ``parse_chat`` turn a decoded JSON body into a ``Ask`` (prompt, limits,
sampling) or raise ``ApiError`` (status, OpenAI error object). Supported fields: ``model``,
``prompt`` (a string, one string in a list, or token ids) / ``messages``, ``max_tokens`` (chat:
also ``max_completion_tokens``), ``temperature`` [0, 2], ``top_p`` (0, 1], ``top_k`` >= 0 (as vLLM
takes it), ``seed``, ``stop`` (a string or up to 4), ``stream``, ``stream_options.include_usage``,
``n`` = 1, ``user``. Fields OpenAI defines that fusec does not implement are refused when set to
anything but their neutral value; any other field is refused (400), as OpenAI does.
"""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any

from fusec.errors import InputError
from fusec.sampling import Sampling

MAX_STOPS = 4
MAX_STOP_CHARS = 256


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error",
                             413: "invalid_request_error", 503: "server_error"}.get(status, "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclasses.dataclass
class Ask:
    """One request, checked: what the batcher and the response need."""

    chat: bool
    prompt_ids: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    model: str


# neutral values of OpenAI fields fusec does not implement (anything else is refused)
_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "n": lambda v: v is None or v == 1,
    "best_of": lambda v: v is None or v == 1,
    "echo": lambda v: v is None or v is False,
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None or v == 0,
    "presence_penalty": lambda v: v is None or v == 0,
    "frequency_penalty": lambda v: v is None or v == 0,
    "logit_bias": lambda v: v is None or v == {},
    "suffix": lambda v: v is None,
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "response_format": lambda v: v is None or v == {"type": "text"},
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "user", "n", "logprobs", "presence_penalty", "frequency_penalty", "logit_bias"}
_COMPLETION_KEYS = _COMMON | {"prompt", "best_of", "echo", "suffix"}
_CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                        "response_format"}
_ROLES = ("system", "developer", "user", "assistant")


def _int(body: Mapping[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise ApiError(400, f"{key} must be an integer, got {type(v).__name__}", key)
    if v < lo or (hi is not None and v > hi):
        raise ApiError(400, f"{key} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}", key)
    return v


def _num(body: Mapping[str, Any], key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ApiError(400, f"{key} must be a number, got {type(v).__name__}", key)
    if not (lo < v <= hi if lo_open else lo <= v <= hi):
        raise ApiError(400, f"{key} must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}", key)
    return float(v)


def _common(body: Any, keys: set[str], model: str, default_seed: Callable[[], int]) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    unknown = sorted(k for k in body if k not in keys)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {unknown[0][:64]}", unknown[0][:64])
    for key, neutral in _NEUTRAL.items():
        if key in body and not neutral(body[key]):
            raise ApiError(400, f"{key} is not supported by this server (leave it out)", key)
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError(400, "model is required (a string: GET /v1/models lists it)", "model")
    if name != model:
        raise ApiError(404, f"The model '{name[:128]}' does not exist (this server serves '{model}')", "model",
                       "model_not_found")
    temperature = _num(body, "temperature", 0.0, 2.0)
    top_p = _num(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = _int(body, "top_k", -1, 2**31 - 1)  # -1: no cut, as vLLM takes it
    seed = _int(body, "seed", -(2**63), 2**64 - 1)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be a boolean", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict) or any(k != "include_usage" for k in opts) \
                or not isinstance(opts.get("include_usage", False), bool):
            raise ApiError(400, "stream_options must be {\"include_usage\": true|false}", "stream_options")
        if not stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
        include_usage = bool(opts.get("include_usage", False))
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
                            f"{MAX_STOP_CHARS} characters", "stop")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ApiError(400, "user must be a string", "user")
    try:
        sampling = Sampling(temperature=temperature if temperature is not None else 1.0,
                            top_k=max(top_k, 0) if top_k is not None else 0,
                            top_p=top_p if top_p is not None else 1.0)
    except InputError as e:
        raise ApiError(400, str(e)) from None
    # seeds of any integer are folded into the row's [0, 2**63) state; no seed: a fresh one
    seed_value = (seed % 2**63) if seed is not None else default_seed()
    return {"sampling": sampling, "seed": seed_value, "stop": stops, "stream": stream, "include_usage": include_usage,
            "model": name}


def _max_tokens(body: Mapping[str, Any], keys: tuple[str, ...], default: int, room: int) -> int:
    for key in keys:
        v = _int(body, key, 1, 2**62)
        if v is not None:
            if v > room:
                raise ApiError(400, f"{key} {v} is more than the {room} tokens the prompt leaves in the plan's "
                                    f"context", key, "context_length_exceeded")
            return v
    return max(1, min(default, room))


def random_seed() -> int:
    return secrets.randbits(63)


def parse_completion(body: Any, model: str, encode: Callable[[str], list[int]], limits: Mapping[str, int],
                     default_seed: Callable[[], int] = random_seed) -> Ask:
    c = _common(body, _COMPLETION_KEYS, model, default_seed)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # one prompt in a list
    if isinstance(prompt, str):
        ids = encode(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ApiError(400, "prompt must be a string or a list of token ids (one prompt per request)", "prompt")
    room = _check_prompt(ids, limits)
    n = _max_tokens(body, ("max_tokens",), 16, room)  # OpenAI's default for completions
    return Ask(False, ids, n, c["sampling"], c["seed"], c["stop"], c["stream"], c["include_usage"], c["model"])


def parse_chat(body: Any, model: str, render: Callable[[list[dict[str, str]]], list[int]],
               limits: Mapping[str, int], default_seed: Callable[[], int] = random_seed) -> Ask:
    c = _common(body, _CHAT_KEYS, model, default_seed)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or len(messages) > 4096:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    plain = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES or any(k not in ("role", "content", "name")
                                                                         for k in m):
            raise ApiError(400, f"messages[{i}] must be an object with a role ({', '.join(_ROLES)}) and a content",
                           f"messages[{i}]")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, f"messages[{i}].content: only text parts are supported",
                               f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", f"messages[{i}].content")
        plain.append({"role": "system" if m["role"] == "developer" else m["role"], "content": content})
    ids = render(plain)
    room = _check_prompt(ids, limits)
    n = _max_tokens(body, ("max_completion_tokens", "max_tokens"), limits["default_max_tokens"], room)
    return Ask(True, ids, n, c["sampling"], c["seed"], c["stop"], c["stream"], c["include_usage"], c["model"])


def _check_prompt(ids: list[int], limits: Mapping[str, int]) -> int:
    """Tokens the prompt leaves for the completion; 400 when it is too long or outside the vocabulary."""
    if not ids:
        raise ApiError(400, "the prompt is empty", "prompt")
    if len(ids) > limits["prompt"]:
        raise ApiError(400, f"the prompt has {len(ids)} tokens; this server takes at most {limits['prompt']}",
                       "prompt", "context_length_exceeded")
    bad = next((t for t in ids if not 0 <= t < limits["vocab"]), None)
    if bad is not None:
        raise ApiError(400, f"token id {bad} is outside the vocabulary [0, {limits['vocab']})", "prompt")
    room = limits["context"] - len(ids)
    if room < 1:
        raise ApiError(400, f"the prompt's {len(ids)} tokens leave no room in the plan's {limits['context']} "
                            "positions", "prompt", "context_length_exceeded")
    return room


# ---- responses ------------------------------------------------------------------------------------

def new_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)


def usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response(ask: Ask, rid: str, created: int, text: str, finish: str, n_prompt: int, n_completion: int) -> dict:
    if ask.chat:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                                  "finish_reason": finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": ask.model, "choices": [choice],
            "usage": usage(n_prompt, n_completion)}


def chunk(ask: Ask, rid: str, created: int, text: str | None, finish: str | None, first: bool = False) -> dict:
    if ask.chat:
        delta: dict[str, Any] = {}
        if first:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": ask.model, "choices": [choice]}


def usage_chunk(ask: Ask, rid: str, created: int, n_prompt: int, n_completion: int) -> dict:
    kind = "chat.completion.chunk" if ask.chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": ask.model, "choices": [],
            "usage": usage(n_prompt, n_completion)}


def models_list(model: str, created: int) -> dict:
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "fusec"}]}


def now() -> int:
    return int(time.time())
