"""The HTTP layer: FastAPI routes over a :class:`~dartcore.serve.pool.WorkerPool`.

``POST /v1/chat/completions``, ``POST /v1/completions`` (``stream`` over SSE),
``GET /v1/models``, ``GET /health``, ``GET /metrics``, ``POST /v1/dart/live/clear`` (drop
the workers' live layers: one scope's or all). Every error is an
OpenAI error body. A streaming response starts only once the worker has
produced the first token (or refused the request), so a refusal still gets its
real status code; a worker that dies after that ends the stream with an
``{"error": ...}`` event instead of ``[DONE]``.

A client that disconnects cancels its generation: streaming, when Starlette
cancels the response; otherwise a task that waits for ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dartcore.serve.pool import Stream, WorkerPool
from dartcore.serve.protocol import (
    APIError,
    GenRequest,
    chunk_body,
    completion_body,
    error_body,
    parse_chat,
    parse_clear,
    parse_completion,
)

__all__ = ["create_app"]

STATS_HEADER = "x-dart-stats"
# Request bodies past this are refused (413) before parsing: a prompt this long is far beyond any
# context the workers hold, and the front forwards prompts to a worker in one pipe message.
MAX_BODY_BYTES = 8 << 20


def _error_response(exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def _dart(req: GenRequest, stream: Stream, item: dict) -> dict | None:
    if not req.want_stats:
        return None
    return {
        "worker": stream.worker,
        "stats": item.get("stats") or {},
        "ttft_s": (stream.first_token - stream.submitted) if stream.first_token else None,
        "latency_s": time.perf_counter() - stream.submitted,
    }


def create_app(
    pool: WorkerPool,
    models: tuple[str, ...],
    *,
    drain_timeout: float = 60.0,
    owned_by: str = "dartcore",
) -> FastAPI:
    """The app; its lifespan starts the pool and, on shutdown (SIGTERM), drains it and stops the workers."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await pool.start()
        try:
            yield
        finally:
            await pool.drain(drain_timeout)
            await pool.close()

    app = FastAPI(
        title="dart-serve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.pool = pool

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(f"{request.method} {request.url.path}: {exc.detail}", type=kind),
            status_code=exc.status_code,
        )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        return JSONResponse(
            error_body(f"internal server error: {type(exc).__name__}: {exc}", type="server_error"),
            status_code=500,
        )

    async def _body(request: Request):
        if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
            raise APIError(
                f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB",
                status=413,
                code="request_too_large",
            )
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise APIError(
                f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB",
                status=413,
                code="request_too_large",
            )
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise APIError(
                f"We could not parse the JSON body of your request ({exc}). The OpenAI API expects a "
                "JSON payload: send a JSON object with Content-Type: application/json",
                param=None,
                code="invalid_json",
            ) from None

    def _header_stats(request: Request) -> bool:
        return request.headers.get(STATS_HEADER, "").strip().lower() in ("1", "true", "yes", "on")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse_chat(
            await _body(request),
            models,
            header_stats=_header_stats(request),
            authorization=request.headers.get("authorization"),
        )
        return await _generate(request, req)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse_completion(
            await _body(request),
            models,
            header_stats=_header_stats(request),
            authorization=request.headers.get("authorization"),
        )
        return await _generate(request, req)

    @app.post("/v1/dart/live/clear")
    async def live_clear(request: Request):
        if not pool.config.learn:
            raise APIError(
                "this server keeps no live layers (dart-serve runs without --learn)",
                code="learn_disabled",
            )
        raw = await request.body()
        scope = parse_clear(await _body(request) if raw.strip() else None)
        workers = await pool.clear_live(scope)
        return {
            "object": "dart.live.clear",
            "scope": scope,
            "scopes": sorted({s for w in workers for s in w["scopes"]}),
            "tokens": sum(w["tokens"] for w in workers),
            "workers": workers,
        }

    async def _until_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def _next(stream: Stream, request: Request | None):
        """The stream's next event; None when the client disconnected first."""
        if request is None:
            return await stream.queue.get()
        get = asyncio.ensure_future(stream.queue.get())
        watch = asyncio.ensure_future(_until_disconnect(request))
        try:
            done, _ = await asyncio.wait({get, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if get in done:
            return get.result()
        get.cancel()
        return None

    async def _generate(request: Request, req: GenRequest):
        stream = pool.submit(req)
        try:
            first = await _next(stream, request)
        except BaseException:
            pool.abort(stream)
            raise
        if first is None:
            pool.abort(stream)
            return JSONResponse(error_body("client disconnected"), status_code=499)
        if first[0] == "error":
            return _error_response(first[1])
        if req.stream:
            return StreamingResponse(
                _sse(stream, first),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        # Non-streaming: gather the text; the disconnect watcher aborts a request nobody waits for.
        event = first
        while True:
            if event is None:
                pool.abort(stream)
                return JSONResponse(error_body("client disconnected"), status_code=499)
            if event[0] == "error":
                return _error_response(event[1])
            item = event[1]
            if item["finished"]:
                return JSONResponse(
                    completion_body(
                        req,
                        item["text"],
                        _finish_reason(item),
                        item["prompt_tokens"],
                        item["completion_tokens"],
                        _dart(req, stream, item),
                    )
                )
            event = await _next(stream, request)

    async def _sse(stream: Stream, first) -> AsyncIterator[str]:
        req = stream.req
        event, opened = first, False
        try:
            while True:
                if event[0] == "error":
                    yield f"data: {json.dumps(event[1].body())}\n\n"
                    return
                item = event[1]
                if item["delta"] or not opened:
                    yield f"data: {json.dumps(chunk_body(req, item['delta'], None, first=not opened))}\n\n"
                    opened = True
                if item["finished"]:
                    usage = (item["prompt_tokens"], item["completion_tokens"])
                    dart = _dart(req, stream, item)
                    yield (
                        "data: "
                        + json.dumps(chunk_body(req, None, _finish_reason(item), dart=dart))
                        + "\n\n"
                    )
                    if req.include_usage:
                        yield f"data: {json.dumps(chunk_body(req, None, None, usage=usage, no_choice=True))}\n\n"
                    yield "data: [DONE]\n\n"
                    return
                event = await stream.queue.get()
        finally:
            pool.abort(stream)  # a no-op once finished; frees the slot when the client went away

    @app.get("/v1/models")
    async def list_models():
        return {
            "object": "list",
            "data": [
                {"id": m, "object": "model", "created": 0, "owned_by": owned_by} for m in models
            ],
        }

    @app.get("/v1/models/{model}")
    async def get_model(model: str):
        if model not in models:
            raise APIError(
                f"The model {model!r} does not exist",
                status=404,
                param="model",
                code="model_not_found",
            )
        return {"id": model, "object": "model", "created": 0, "owned_by": owned_by}

    @app.get("/health")
    async def health():
        status = pool.status()
        ready = any(w["ready"] for w in status["workers"]) and not status["draining"]
        status["status"] = "ok" if ready else "unavailable"
        return JSONResponse(status, status_code=200 if ready else 503)

    @app.get("/metrics")
    async def metrics():
        inflight = {h.index: len(h.inflight) for h in pool.handles}
        return PlainTextResponse(
            pool.metrics.render(inflight), media_type="text/plain; version=0.0.4"
        )

    return app


def _finish_reason(item: dict) -> str:
    reason = item.get("finish_reason")
    return "length" if reason == "length" else "stop"
