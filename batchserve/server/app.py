"""The OpenAI-compatible HTTP app: validate -> AsyncEngine.add -> JSON or SSE.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, POST /tokenize,
POST /detokenize, GET /version, GET /health (and /health/ready, the same; /health/live),
GET /metrics, GET /openapi.json and GET /docs (its schema: openapi.py). Every error is OpenAI-shaped JSON (see
protocol.APIError); a 5xx body never holds exception text, only a request id the log has.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import importlib.metadata
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchserve.core.batch import RequestOutput
from batchserve.engine.async_engine import AsyncEngine
from batchserve.engine.client import EngineClient, EngineStoppedError
from batchserve.engine.engine import LLMEngine
from batchserve.engine.request_stream import RequestStream
from batchserve.request import OverloadedError, RequestError, RequestSpec
from batchserve.server.config import ServerConfig
from batchserve.server.guard import Guard
from batchserve.server.metrics import ServerMetrics
from batchserve.server import openapi
from batchserve.server.protocol import (APIError, GenerationRequest, _messages, _refuse_unknown, bad,
                                        parse_generation, parse_json)
from batchserve.server.responses import (ChunkWriter, best_candidates, completion_body, output_error, retry_after,
                                         usage)

log = logging.getLogger(__name__)
T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _StreamEnd:
    """The once-only end of a streamed request: abort it if unfinished, count it out."""

    def __init__(self, state: "ServerState", stream: RequestStream | list[RequestStream]) -> None:
        self.state, self.streams, self.ended = state, stream if isinstance(stream, list) else [stream], False

    def __call__(self) -> None:
        if self.ended:
            return
        self.ended = True
        for s in self.streams:
            if not s.finished:
                self.state.engine.abort(s.request_id)
        self.state.inflight -= 1

    async def later(self) -> None:  # async, so Starlette runs it on the event loop
        self()


class ServerState:
    """Everything the routes share: config, engine, metrics, draining flag, in-flight count.
    `fatal` is set when the engine died; `on_fatal` (set by whoever runs the server) is then
    called once, to stop the process with a non-zero status."""

    def __init__(self, engine: EngineClient, config: ServerConfig, model_name: str) -> None:
        self.config = config
        self.model_name = model_name
        self.metrics = ServerMetrics(model_name)
        self.engine = engine
        engine.attach(self.metrics.observe_step, self.metrics.observe_finish)
        engine.on_dead = self._engine_died
        self.fatal: BaseException | None = None
        self.on_fatal: Callable[[], None] | None = None
        self.created = int(time.time())
        self.draining = False
        self.inflight = 0  # generation requests being answered (streams included)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _engine_died(self, error: BaseException) -> None:
        if getattr(self.engine, "load_error", None) is not None:
            log.critical("the model failed to load (%s); the server stops", error)
        else:
            log.critical("the engine thread died (%s); the server stops", type(error).__name__)
        self.fatal = error
        if self.on_fatal is not None:
            self.on_fatal()

    # --- checks ------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        key = self.config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_admission(self) -> None:
        if self.draining:
            self.metrics.rejected.labels("shutting_down", "default").inc()
            raise APIError(503, "the server is shutting down; retry on another instance", code="shutting_down",
                           type="overloaded_error", headers=retry_after(5))
        health = self.engine.health()
        if health.state == "stalled":
            raise APIError(503, "the engine is stalled (a model step is running far too long); retry later",
                           code="engine_stalled", type="overloaded_error", headers=retry_after(5))
        if not self.engine.ready:
            raise APIError(503, "the model is not loaded yet" if health.state == "loading" else
                           "the engine is not running", code="not_ready", type="overloaded_error",
                           headers=retry_after(5))

    async def read_json(self, request: Request) -> dict[str, Any]:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != "application/json":
            raise APIError(400, f"Content-Type must be application/json, got {ctype or 'none'!r}",
                           code="invalid_content_type")
        limit = self.config.max_body_bytes
        length = request.headers.get("content-length", "")
        too_big = APIError(413, f"request body exceeds {limit} bytes", code="request_too_large")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_big
            chunks.append(chunk)
        return parse_json(b"".join(chunks), self.config.max_json_depth)

    async def until_disconnect(self, request: Request, aw: Awaitable[T], rid: str | list[str]) -> T:
        """Await `aw` unless the client leaves first; then abort the request(s) at once."""
        task = asyncio.ensure_future(aw)
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                for r in [rid] if isinstance(rid, str) else rid:
                    self.engine.abort(r)
        if not task.done() or task.cancelled():
            raise ClientGone(rid)
        return task.result()

    # --- generation --------------------------------------------------------------------
    async def generate(self, request: Request, chat: bool) -> Response:
        arrival = self.engine.now()
        self.check_auth(request)
        self.check_admission()
        g = parse_generation(await self.read_json(request), chat, self.config.default_max_tokens,
                             lenient=self.config.lenient_fields, priority_order=self.config.priority_order)
        if g.model != self.model_name:
            raise APIError(404, f"model {g.model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        request.state.request_id = rid  # for the access log and any 5xx body
        self.inflight += 1
        handed_to_stream = False
        try:
            if len(g.specs) > 1:
                return await self._generate_many(request, g, rid, arrival)
            stream = await self._add(g.spec, rid, arrival)
            if g.stream:  # wait for the first output, so an early failure still gets its status code
                first = await self.until_disconnect(request, stream.next(), rid)
                self._raise_if_failed(first)
                stream.seen = True  # its first chunk goes out now: from here it cannot start over
                handed_to_stream = True
                end = _StreamEnd(self, stream)
                # `end` runs from the generator's finally and as a background task: the
                # generator may never start if the client leaves just before the first chunk.
                return StreamingResponse(self._sse(g, rid, stream, first, end), media_type="text/event-stream",
                                         headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
                                         background=BackgroundTask(end.later))
            out = await self.until_disconnect(request, stream.collect(), rid)
            self._raise_if_failed(out)
            return JSONResponse(completion_body(rid, int(time.time()), g.model, out, chat,
                                                self.config.native_finish_reasons, self.engine.token_text,
                                                prefixes=self._echoes(g), tool_calling=g.tool_calling),
                                headers={"X-Request-Id": rid})
        except ClientGone:
            return Response(status_code=499)  # nobody is listening; for the logs only
        finally:
            if not handed_to_stream:
                self.inflight -= 1

    def _echoes(self, g: GenerationRequest) -> list[str] | None:
        """With echo, each choice's prompt text (token-id prompts decoded)."""
        if not g.echo:
            return None
        tok = self.engine.text_tokenizer
        return [s.prompt if isinstance(s.prompt, str) else
                (tok.decode(s.prompt) if tok is not None else "") for s in g.specs]

    async def _generate_many(self, request: Request, g: GenerationRequest, rid: str, arrival: float) -> Response:
        """Several choices (n > 1, several prompts, or best_of's candidates): one engine request
        each, answered together; any one failing fails the whole request, as a single one would.
        The copies of one prompt form a group, so the engine prefills that prompt once. With
        best_of > n, each prompt's n best candidates are answered (responses.best_candidates)
        and usage counts every candidate's tokens."""
        k = g.candidates
        streams = await self._add_many([dataclasses.replace(
            spec, request_id=f"{rid}-{i}", arrival_time=arrival, group=f"{rid}-p{i // k}" if k > 1 else None)
            for i, spec in enumerate(g.specs)])
        ids = [s.request_id for s in streams]

        def fail_all(outs: list[RequestOutput]) -> None:
            try:
                for out in outs:
                    self._raise_if_failed(out)
            except APIError:
                for s in streams:
                    if not s.finished:
                        self.engine.abort(s.request_id)
                raise

        if not g.stream:
            outs = list(await self.until_disconnect(request, asyncio.gather(*(s.collect() for s in streams)), ids))
            fail_all(outs)
            echoes, used = self._echoes(g), None
            if k > g.n:  # best_of
                used = usage(outs, k)
                picked = best_candidates(outs, k, g.n)
                outs = [dataclasses.replace(outs[i], logprobs=None, new_logprobs=None) if g.ranking_logprobs
                        else outs[i] for i in picked]
                echoes = [echoes[i] for i in picked] if echoes else None
            return JSONResponse(completion_body(rid, int(time.time()), g.model, outs, g.chat,
                                                self.config.native_finish_reasons, self.engine.token_text, g.n,
                                                echoes, g.tool_calling, used),
                                headers={"X-Request-Id": rid})
        firsts = await self.until_disconnect(request, asyncio.gather(*(s.next() for s in streams)), ids)
        fail_all(firsts)
        for s in streams:
            s.seen = True
        end = _StreamEnd(self, streams)
        self.inflight += 1  # the stream's own count: `end` takes it back; the caller's comes back now
        return StreamingResponse(self._sse_many(g, rid, streams, list(firsts), end), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid},
                                 background=BackgroundTask(end.later))

    async def _sse_many(self, g: GenerationRequest, rid: str, streams: list[RequestStream],
                        firsts: list[RequestOutput], end: "_StreamEnd") -> AsyncIterator[bytes]:
        created, echoes = int(time.time()), self._echoes(g)
        writers = [ChunkWriter(rid, created, g.model, g.chat, g.include_usage, self.config.native_finish_reasons,
                               self.engine.token_text, index=i, last=False, prefix=echoes[i] if echoes else "",
                               tool_calling=g.tool_calling)
                   for i in range(len(streams))]
        finals: list[RequestOutput | None] = [None] * len(streams)
        pending: dict[asyncio.Future, int] = {}
        try:
            for i, out in enumerate(firsts):
                yield writers[i].write(out)
                if out.finished:
                    finals[i] = out
                else:
                    pending[asyncio.ensure_future(streams[i].next())] = i
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    out = task.result()
                    chunk = writers[i].write(out)
                    if out.finished and output_error(out) is not None:  # the error event ends the stream
                        yield chunk
                        return
                    yield chunk
                    if out.finished:
                        finals[i] = out
                    else:
                        pending[asyncio.ensure_future(streams[i].next())] = i
            yield writers[0].end(usage([o for o in finals if o is not None], g.n))
        finally:  # also on disconnect
            for task in pending:
                task.cancel()
            end()

    async def _add(self, spec: RequestSpec, rid: str, arrival: float) -> RequestStream:
        return (await self._add_many([dataclasses.replace(spec, request_id=rid, arrival_time=arrival)]))[0]

    async def _add_many(self, specs: list[RequestSpec]) -> list[RequestStream]:
        """Queue the specs (ids and arrival set) together; an engine error as its HTTP error."""
        try:
            if len(specs) == 1:
                return [await self.engine.add(specs[0])]
            return await self.engine.add_many(specs)
        except RequestError as e:
            raise bad(e.param, e.message) from None
        except OverloadedError as e:
            self.metrics.rejected.labels("queue_full", e.level or "default").inc()
            raise APIError(503, str(e), code="queue_full", type="overloaded_error",
                           headers=retry_after(e.retry_after_s)) from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), code="not_ready", type="overloaded_error", headers=retry_after(5)) from None

    # --- tokenizer routes ---------------------------------------------------------------
    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def _engine_call(self, aw: Awaitable[T]) -> T:
        try:
            return await aw
        except RequestError as e:
            raise bad(e.param, e.message) from None
        except EngineStoppedError as e:
            raise APIError(503, str(e), code="not_ready", type="overloaded_error", headers=retry_after(5)) from None
        except NotImplementedError:
            raise APIError(501, "this engine does not tokenize here", code="not_implemented") from None

    async def tokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /tokenize: {"prompt"} or {"messages", "add_generation_prompt"?} (+ "model"?)
        -> {"count", "max_model_len", "tokens"}, tokenized as a generation request would be."""
        self.check_auth(request)
        self.check_admission()
        body = await self.read_json(request)
        chat = "messages" in body
        _refuse_unknown(body, frozenset({"model", "add_special_tokens", *(
            ("messages", "add_generation_prompt") if chat else ("prompt",))}))
        self._check_model(body)
        if body.get("add_special_tokens") not in (None, False):
            raise bad("add_special_tokens", "only false is supported (prompts are encoded without special "
                      "tokens)", code="unsupported_parameter")
        if chat:
            add_gen = body.get("add_generation_prompt")
            if add_gen is not None and not isinstance(add_gen, bool):
                raise bad("add_generation_prompt", "must be true or false")
            ids = await self._engine_call(self.engine.tokenize(
                messages=_messages(body, self.config.lenient_fields), add_generation_prompt=add_gen is not False))
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise bad("prompt", "is required and must be a string")
            ids = await self._engine_call(self.engine.tokenize(prompt))
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}

    async def detokenize(self, request: Request) -> dict[str, Any]:
        """vLLM's /detokenize: {"tokens": [ids]} (+ "model"?) -> {"prompt": text}."""
        self.check_auth(request)
        self.check_admission()
        body = await self.read_json(request)
        _refuse_unknown(body, frozenset({"model", "tokens"}))
        self._check_model(body)
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad("tokens", "is required and must be a list of integer token ids")
        return {"prompt": await self._engine_call(self.engine.detokenize(ids))}

    @staticmethod
    def _raise_if_failed(out: RequestOutput) -> None:
        if out.finished:
            err = output_error(out)
            if err is not None:
                raise err

    async def _sse(self, g: GenerationRequest, rid: str, stream: RequestStream, first: RequestOutput,
                   end: "_StreamEnd") -> AsyncIterator[bytes]:
        echo = self._echoes(g)
        writer = ChunkWriter(rid, int(time.time()), g.model, g.chat, g.include_usage,
                             self.config.native_finish_reasons, self.engine.token_text, prefix=echo[0] if echo else "",
                             tool_calling=g.tool_calling)
        try:
            out = first
            yield writer.write(out)
            while not out.finished:
                out = await stream.next()
                yield writer.write(out)
        finally:  # also on disconnect: Starlette cancels this generator when the client leaves
            end()

    # --- draining (SIGTERM) ------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        """Refuse new requests, wait up to `grace_s` for in-flight ones, abort the rest."""
        self.draining = True
        log.info("draining: %d requests in flight, grace period %.1f s", self.inflight, grace_s)
        end = time.monotonic() + grace_s
        while self.inflight > 0 and time.monotonic() < end:
            await asyncio.sleep(0.05)
        if self.inflight > 0:
            log.warning("grace period over: aborting %d requests", self.inflight)
            self.engine.abort_all()
            end = time.monotonic() + 2.0
            while self.inflight > 0 and time.monotonic() < end:
                await asyncio.sleep(0.05)


def _version() -> str:
    import batchserve

    try:
        return importlib.metadata.version("batchserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return batchserve.__version__


def create_app(engine: EngineClient | LLMEngine | Callable[[], LLMEngine], config: ServerConfig | None = None,
               model_name: str = "batchserve") -> FastAPI:
    """The app around an engine client, or around an engine (or a factory that builds one on
    the engine thread: /health answers 503 until it is done) run by an AsyncEngine. The engine
    runs while the app's lifespan does."""
    config = config or ServerConfig()
    client = engine if isinstance(engine, EngineClient) else AsyncEngine(engine, step_timeout_s=config.step_timeout_s)
    state = ServerState(client, config, config.served_model_name or model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.loop = asyncio.get_running_loop()
        state.engine.start(state.loop)
        yield
        await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="batchserve", version=_version(), lifespan=lifespan, redoc_url=None)
    app.state.server = state
    app.add_middleware(Guard, config=config, on_status=lambda status: state.metrics.http_errors.labels(str(status)).inc())

    def error_response(e: APIError) -> JSONResponse:
        state.metrics.http_errors.labels(str(e.status)).inc()
        if e.status >= 500 or e.status == 401:
            log.info("%d %s: %s", e.status, e.code, e.message)
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code)
        return error_response(APIError(e.status_code, str(e.detail), code=code, headers=dict(e.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, str(e)))

    @app.exception_handler(Exception)
    async def on_crash(request: Request, e: Exception) -> JSONResponse:
        rid = getattr(request.state, "request_id", "-")
        log.exception("unhandled error on %s (request id %s)", request.url.path, rid)
        return error_response(APIError(500, f"internal error (request id {rid})", type="server_error",
                                       code="internal_error", headers={"X-Request-Id": rid}))

    name = state.model_name
    completion = {"type": "object", "description": "an OpenAI completion object"}
    gen_errors = (400, 401, 404, 413, 429, 503, 504)

    @app.post("/v1/completions", openapi_extra=openapi.route(
        openapi.request_schema(False, name), completion, "a completion, or server-sent events when stream is true",
        errors=gen_errors))
    async def completions(request: Request) -> Response:
        return await state.generate(request, chat=False)

    @app.post("/v1/chat/completions", openapi_extra=openapi.route(
        openapi.request_schema(True, name), completion, "a chat completion, or server-sent events when stream is "
        "true", errors=gen_errors))
    async def chat_completions(request: Request) -> Response:
        return await state.generate(request, chat=True)

    @app.post("/tokenize", openapi_extra=openapi.route(openapi.tokenize_schema(name), openapi.TOKENIZE_OK,
                                                       errors=(400, 401, 404, 413, 501, 503)))
    async def tokenize(request: Request) -> dict[str, Any]:
        return await state.tokenize(request)

    @app.post("/detokenize", openapi_extra=openapi.route(openapi.DETOKENIZE, openapi.DETOKENIZE_OK,
                                                         errors=(400, 401, 404, 413, 501, 503)))
    async def detokenize(request: Request) -> dict[str, Any]:
        return await state.detokenize(request)

    @app.get("/version")
    async def version() -> dict[str, str]:
        """batchserve's package version."""
        return {"version": _version()}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        state.check_auth(request)
        card: dict[str, Any] = {"id": state.model_name, "object": "model", "created": state.created,
                                "owned_by": "batchserve"}
        if state.engine.ready:
            card["max_model_len"] = state.engine.max_model_len
        return {"object": "list", "data": [card]}

    def health_body(ready: bool) -> JSONResponse:
        h = state.engine.health()
        status = "draining" if state.draining and h.state == "ok" else h.state
        ok = status == "ok" if ready else h.live
        body: dict[str, Any] = {"status": status}
        if h.error is not None:
            body["error"] = h.error
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/health")
    async def health() -> JSONResponse:
        """200 only while requests are being taken: loaded, not draining, not stalled, not dead."""
        return health_body(ready=True)

    @app.get("/health/ready")
    async def health_ready() -> JSONResponse:
        return health_body(ready=True)

    @app.get("/health/live")
    async def health_live() -> JSONResponse:
        """200 unless serving cannot resume without a restart (stalled, dead, failed to load)."""
        return health_body(ready=False)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        state.check_auth(request)
        eng = state.engine
        h = eng.health()
        snapshot = None
        if eng.ready and h.state == "ok":  # a stalled engine thread would not answer
            try:
                snapshot = await asyncio.wait_for(eng.snapshot(), timeout=2.0)
            except asyncio.TimeoutError:
                pass
        text = state.metrics.render(snapshot, h) + eng.metrics_text().encode()
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    return app
