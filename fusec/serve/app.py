"""The HTTP side of ``fusec serve``: Starlette routes on uvicorn (the ``serve`` extra).

Starlette + uvicorn rather than aiohttp: both are maintained, but Starlette's streaming responses
end the response generator when the client disconnects (which is how a row is freed mid-stream),
and the two are pure-Python wheels (plus h11, anyio, click), which matters on a GPU machine that
cannot reach a package registry. No HTTP parsing is written here.

The event loop never waits for the GPU: requests go to the engine thread (``Batcher.submit``) and
its events come back in one ``call_soon_threadsafe`` per step. Errors are OpenAI error objects,
never a traceback; one access-log line per request goes to stderr.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
import traceback
from collections.abc import AsyncIterator, Callable
from typing import Any

from fusec.errors import FusecError, InputError
from fusec.serve import protocol as P
from fusec.serve.batcher import Batcher, Job, QueueFull, ShuttingDown
from fusec.serve.metrics import Metrics
from fusec.serve.text import TextStream


class JobFailed(Exception):
    pass


class Server:
    """What the routes share: the batcher, the tokenizer, the limits, the metrics."""

    def __init__(self, batcher: Batcher, tokenizer: Any, model: str, *, api_key: str | None = None,
                 max_body: int = 1 << 20, default_max_tokens: int = 256, log: Callable[[str], None] | None = None,
                 chat_template: str | None = None):
        self.batcher, self.tok, self.model = batcher, tokenizer, model
        self.api_key = api_key.encode("utf-8") if api_key else None
        self.max_body = max_body
        self.limits = {"prompt": batcher.prefill_len, "context": batcher.max_seq_len, "vocab": batcher.vocab,
                       "default_max_tokens": default_max_tokens}
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self.chat_template = chat_template
        self.created = P.now()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.metrics = Metrics(batcher)
        batcher.on_events = self._from_engine

    # ---- engine thread -> event loop ------------------------------------------------------------

    def _from_engine(self, events: list[tuple[Job, list[int], bool]]) -> None:
        loop = self.loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile (shutdown)
                loop.call_soon_threadsafe(self._dispatch, events)

    @staticmethod
    def _dispatch(events: list[tuple[Job, list[int], bool]]) -> None:
        for job, toks, fin in events:
            if job.tag is not None:
                job.tag.put_nowait((toks, fin))

    # ---- helpers --------------------------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        if self.tok is None:
            raise P.ApiError(400, "this model carries no tokenizer: give the prompt as a list of token ids", "prompt")
        try:
            return list(self.tok.encode(text))
        except InputError as e:
            raise P.ApiError(400, str(e), "prompt") from None

    def render(self, messages: list[dict[str, str]]) -> list[int]:
        if self.tok is None:
            raise P.ApiError(400, "this model carries no tokenizer or chat template: use /v1/completions with "
                                  "token ids", "messages")
        try:
            text = self.tok.apply_chat_template(messages, add_generation_prompt=True, template=self.chat_template)
            return list(self.tok.encode(text, add_bos=False))
        except FusecError as e:
            raise P.ApiError(400, f"the chat template cannot render these messages: {e}", "messages") from None

    def authorize(self, request: Any) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        token = given[7:].strip() if given[:7].lower() == "bearer " else ""
        if not hmac.compare_digest(token.encode("utf-8", "surrogateescape"), self.api_key):
            raise P.ApiError(401, "Incorrect API key provided", None, "invalid_api_key")

    async def read_json(self, request: Any) -> Any:
        length = request.headers.get("content-length")
        too_big = P.ApiError(413, f"the request body is larger than {self.max_body} bytes", None, "request_too_large")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            await _discard(request, 16 * self.max_body)  # so that the client reads the answer, not a reset
            raise too_big
        chunks, size = [], 0
        async for part in request.stream():
            size += len(part)
            if size > self.max_body:
                await _discard(request, 16 * self.max_body)
                raise too_big
            chunks.append(part)
        try:
            text = b"".join(chunks).decode("utf-8")
        except UnicodeDecodeError as e:
            raise P.ApiError(400, f"the request body is not UTF-8 (byte {e.start})") from None
        try:
            return json.loads(text)
        except (ValueError, RecursionError) as e:
            raise P.ApiError(400, f"the request body is not valid JSON: {str(e)[:120]}") from None

    # ---- routes ---------------------------------------------------------------------------------

    async def generate(self, request: Any, chat: bool) -> Any:
        from starlette.responses import JSONResponse, StreamingResponse

        t0 = time.perf_counter()
        rec = {"method": request.method, "path": request.url.path, "status": 200, "prompt": 0, "completion": 0,
               "t0": t0, "ttft": None}
        try:
            self.authorize(request)
            body = await self.read_json(request)
            if chat:
                ask = await asyncio.to_thread(P.parse_chat, body, self.model, self.render, self.limits)
            else:
                ask = await asyncio.to_thread(P.parse_completion, body, self.model, self.encode, self.limits)
            job = Job(ask.prompt_ids, ask.max_tokens, ask.sampling, ask.seed, tag=asyncio.Queue())
            try:
                self.batcher.submit(job)
            except (QueueFull, ShuttingDown) as e:
                raise P.ApiError(503, f"the server is busy: {e}" if isinstance(e, QueueFull) else str(e), None,
                                 "server_overloaded" if isinstance(e, QueueFull) else "shutting_down") from None
            except InputError as e:
                raise P.ApiError(400, str(e)) from None
        except P.ApiError as e:
            return self._error(e, rec)
        rec["prompt"] = len(ask.prompt_ids)
        rid, created = P.new_id(chat), P.now()
        text = TextStream(self.tok, ask.stop)
        if ask.stream:
            return StreamingResponse(self._sse(job, ask, text, rid, created, rec), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect = asyncio.ensure_future(self._collect(job, text))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not collect.done():  # the client went away: free its row
            self.batcher.cancel(job)
            collect.cancel()
            rec["status"] = 499
            self._done(rec, job)
            return JSONResponse(P.error_body("client closed the request", "invalid_request_error"), status_code=499)
        try:
            out, finish = collect.result()
        except JobFailed as e:
            return self._error(P.ApiError(503, str(e), None, "generation_failed"), rec, job)
        rec["completion"] = len(job.tokens)
        self._done(rec, job)
        return JSONResponse(P.response(ask, rid, created, out, finish, len(ask.prompt_ids), len(job.tokens)))

    async def _pieces(self, job: Job, text: TextStream) -> AsyncIterator[tuple[str, str | None]]:
        """(new text, finish reason or None) as the engine draws; a stop string cancels the job."""
        q: asyncio.Queue = job.tag
        while True:
            toks, fin = await q.get()
            toks = list(toks)
            while not fin and not q.empty():  # coalesce what has arrived meanwhile
                more, fin = q.get_nowait()
                toks += more
            if fin and job.finish == "error":
                raise JobFailed(job.error or "the generation failed")
            piece = text.add(toks, final=fin)
            if text.stopped:
                if not fin:
                    self.batcher.cancel(job)
                yield piece, "stop"
                return
            if fin:
                yield piece, "length" if job.finish == "length" else "stop"
                return
            if piece:
                yield piece, None

    async def _collect(self, job: Job, text: TextStream) -> tuple[str, str]:
        out, finish = [], "stop"
        async for piece, fin in self._pieces(job, text):
            out.append(piece)
            finish = fin or finish
        return "".join(out), finish

    async def _sse(self, job: Job, ask: P.Ask, text: TextStream, rid: str, created: int,
                   rec: dict[str, Any]) -> AsyncIterator[str]:
        first = ask.chat
        try:
            if first:  # the role comes first, as OpenAI sends it
                yield _data(P.chunk(ask, rid, created, "", None, first=True))
            async for piece, fin in self._pieces(job, text):
                if piece:
                    yield _data(P.chunk(ask, rid, created, piece, None))
                if fin is not None:
                    yield _data(P.chunk(ask, rid, created, None if ask.chat else "", fin))
                    if ask.include_usage:
                        yield _data(P.usage_chunk(ask, rid, created, len(ask.prompt_ids), len(job.tokens)))
                    yield "data: [DONE]\n\n"
        except JobFailed as e:
            rec["status"] = 503
            yield _data(P.error_body(str(e), "server_error", None, "generation_failed"))
            yield "data: [DONE]\n\n"
        finally:
            if job.finish is None:  # the client went away mid-stream: free its row
                self.batcher.cancel(job)
                rec["status"] = 499
            rec["completion"] = len(job.tokens)
            self._done(rec, job)

    def _error(self, e: P.ApiError, rec: dict[str, Any], job: Job | None = None) -> Any:
        from starlette.responses import JSONResponse

        rec["status"] = e.status
        self._done(rec, job)
        return JSONResponse(e.body(), status_code=e.status)

    def _done(self, rec: dict[str, Any], job: Job | None) -> None:
        """The access-log line and the metrics of one finished request."""
        total = time.perf_counter() - rec["t0"]
        ttft = (job.t_first - rec["t0"]) if job is not None and job.t_first is not None else None
        n = rec["completion"]
        decode_s = (job.t_end - job.t_first) if job is not None and job.t_end and job.t_first else 0.0
        tok_s = (n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0
        self.metrics.request(rec["path"], rec["status"], rec["prompt"], n, ttft, total)
        self.log(f"{rec['method']} {rec['path']} {rec['status']} prompt_tokens={rec['prompt']} "
                 f"completion_tokens={n} ttft_ms={'-' if ttft is None else f'{ttft * 1e3:.1f}'} "
                 f"tok_s={tok_s:.1f} total_ms={total * 1e3:.1f}")

    async def simple(self, request: Any, what: str) -> Any:
        from starlette.responses import JSONResponse, Response

        rec = {"method": request.method, "path": request.url.path, "status": 200, "prompt": 0, "completion": 0,
               "t0": time.perf_counter()}
        try:
            if what == "models":
                self.authorize(request)
                return JSONResponse(P.models_list(self.model, self.created))
            if what == "health":
                stopping = self.batcher.stopping
                if stopping is not None:
                    rec["status"] = 503
                    return JSONResponse({"status": "unavailable", "reason": stopping}, status_code=503)
                return JSONResponse({"status": "ok", **self.batcher.stats()})
            body, ctype = self.metrics.render()
            return Response(body, media_type=ctype)
        except P.ApiError as e:
            return self._error(e, rec)
        finally:
            if rec["status"] < 400:
                self._done(rec, None)

    def app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
        from starlette.routing import Route

        async def completions(request: Any) -> Any:
            return await self.generate(request, chat=False)

        async def chat(request: Any) -> Any:
            return await self.generate(request, chat=True)

        async def models(request: Any) -> Any:
            return await self.simple(request, "models")

        async def health(request: Any) -> Any:
            return await self.simple(request, "health")

        async def metrics(request: Any) -> Any:
            return await self.simple(request, "metrics")

        async def http_error(request: Any, exc: Any) -> Any:
            rec = {"method": request.method, "path": request.url.path, "status": exc.status_code, "prompt": 0,
                   "completion": 0, "t0": time.perf_counter()}
            msg = "not found" if exc.status_code == 404 else str(exc.detail)
            return self._error(P.ApiError(exc.status_code, f"{request.method} {request.url.path[:200]}: {msg}"), rec)

        async def crash(request: Any, exc: Exception) -> Any:
            rec = {"method": request.method, "path": request.url.path, "status": 500, "prompt": 0,
                   "completion": 0, "t0": time.perf_counter()}
            self.log(f"internal error: {type(exc).__name__}: {exc}")
            if _debug():
                traceback.print_exception(exc)
            return self._error(P.ApiError(500, f"internal error ({type(exc).__name__})"), rec)

        @contextlib.asynccontextmanager
        async def lifespan(app: Any) -> AsyncIterator[None]:
            self.loop = asyncio.get_running_loop()
            self.batcher.start()
            yield
            self.batcher.shutdown(wait=10.0)

        routes = [Route("/v1/completions", completions, methods=["POST"]),
                  Route("/v1/chat/completions", chat, methods=["POST"]),
                  Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
                  Route("/metrics", metrics, methods=["GET"])]
        return Starlette(routes=routes, lifespan=lifespan,
                         exception_handlers={HTTPException: http_error, Exception: crash})


def _data(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _discard(request: Any, cap: int) -> None:
    seen = 0
    with contextlib.suppress(Exception):
        async for part in request.stream():
            seen += len(part)
            if seen > cap:
                break


async def _disconnected(request: Any) -> None:
    """Returns once the client has gone away (the body has been read already)."""
    while True:
        msg = await request.receive()
        if msg.get("type") == "http.disconnect":
            return


def _debug() -> bool:
    from fusec import knobs

    return bool(knobs.get("FUSEC_DEBUG"))


def run(server: Server, host: str, port: int, on_ready: Callable[[int], None] | None = None) -> None:
    """Serve until SIGINT/SIGTERM: in-flight requests end with an error (streams: an error chunk and
    ``[DONE]``), queued ones too; then uvicorn closes the connections and returns."""
    import uvicorn

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            server.batcher.shutdown("the server is shutting down")
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if on_ready is not None and self.servers:
                on_ready(self.servers[0].sockets[0].getsockname()[1])

    config = uvicorn.Config(server.app(), host=host, port=port, access_log=False, log_level="warning",
                            timeout_graceful_shutdown=10, lifespan="on")
    _Uvicorn(config).run()
