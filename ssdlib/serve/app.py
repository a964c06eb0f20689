"""The FastAPI app: OpenAI-compatible routes on an :class:`AsyncEngine`.

Errors are OpenAI error bodies: 400 a bad field, 401 a missing or wrong API key, 404 an unknown
model or route, 413 a prompt longer than the context, 503 the queue is full or the engine failed.
A bad request never reaches the engine. When the engine fails, ``/health`` answers 503 and
``on_engine_failure`` is called (the CLI stops the server and exits non-zero).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssdlib.errors import ConfigError
from ssdlib.sampling import SamplingParams
from ssdlib.serve import openai_api as api
from ssdlib.serve.async_engine import AsyncEngine, EngineFailed, QueueFull
from ssdlib.serve.metrics import ServerMetrics


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, api.error_body(message, type_, param, code)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def create_app(generator, model_name: str, max_queue: int = 64, api_key: str | None = None,
               on_engine_failure=None) -> FastAPI:
    """The app serving ``generator`` (started, leader rank) as ``model_name``; the engine
    starts and stops with the app's lifespan."""
    metrics = ServerMetrics({"mode": generator.cfg.mode, "model": model_name,
                             "max_batch": str(generator.cfg.max_batch)})
    engine = AsyncEngine(generator, max_queue, metrics)
    metrics.bind(engine)
    max_context = generator.max_context

    @asynccontextmanager
    async def lifespan(app):
        await engine.start()
        watch = asyncio.create_task(_watch())
        yield
        watch.cancel()
        await engine.close()

    async def _watch():
        while engine.failure is None:
            await asyncio.sleep(0.2)
        if on_engine_failure is not None:
            on_engine_failure(engine.failure)

    app = FastAPI(title="ssdlib", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        msg = first.get("msg", "invalid request")
        return JSONResponse(api.error_body(f"{'.'.join(loc) or 'body'}: {msg}",
                                           "invalid_request_error", ".".join(loc) or None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(api.error_body(str(exc.detail), kind), status_code=exc.status_code)

    async def check_key(request: Request) -> None:
        # a dependency, not an HTTP middleware: Starlette's BaseHTTPMiddleware would hide a
        # client's disconnect from the streaming response (its slot would not be freed)
        if api_key is not None:
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                raise APIError(401, "missing or invalid API key", "authentication_error",
                               code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_key)])

    @app.get("/health")
    async def health():
        if not engine.healthy:
            return JSONResponse({"status": "failed", "error": str(engine.failure)},
                                status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @v1.get("/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "ssdlib"}]}

    def _params(body: api._Sampling, max_tokens: int | None) -> SamplingParams:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist (this server has "
                                f"{model_name!r})", "not_found_error", "model", "model_not_found")
        if body.n != 1:
            raise _bad("only n=1 is supported", "n")
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        temperature = 1.0 if body.temperature is None else body.temperature
        try:
            return SamplingParams(max_new_tokens=max_tokens or max_context,
                                  temperature=temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p,
                                  top_k=body.top_k or 0, seed=body.seed, stop=stop,
                                  ignore_eos=body.ignore_eos)
        except ConfigError as e:
            raise _bad(str(e)) from None

    def _encode(prompt, chat: bool) -> list[int]:
        try:
            ids = generator.encode(prompt, chat=chat)
        except ConfigError as e:
            raise _bad(str(e), "messages" if chat else "prompt") from None
        if not generator.prompts.fits(ids):
            raise APIError(413, f"the prompt has {len(ids)} tokens; this server's context is "
                                f"{max_context} tokens including the answer",
                           "invalid_request_error", "messages" if chat else "prompt",
                           "context_length_exceeded")
        return ids

    def _submit(ids, params):
        try:
            return engine.submit(ids, params)
        except QueueFull as e:
            raise APIError(503, str(e), "server_overloaded", code="queue_full") from None
        except EngineFailed as e:
            raise APIError(503, str(e), "server_error", code="engine_failed") from None

    @v1.post("/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest):
        params = _params(body, body.max_completion_tokens or body.max_tokens)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = _encode({"messages": messages}, chat=True)
        stream = _submit(ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def first():
                return api.chat_chunk(rid, model_name, {"role": "assistant", "content": ""}, None)

            def piece(delta):
                finish = api.FINISH_REASONS.get(delta.finish_reason) if delta.finish_reason else None
                return api.chat_chunk(rid, model_name, {"content": delta.text}
                                      if delta.text or not finish else {}, finish)

            def last(out):
                return api.chat_chunk(rid, model_name, {}, None, _usage(out))

            return _sse(stream, first, piece, last if include_usage else None)
        out = await _collect(stream)
        return api.chat_response(rid, model_name, out.text,
                                 api.FINISH_REASONS[out.finish_reason], _usage(out))

    @v1.post("/completions")
    async def completions(body: api.CompletionRequest):
        params = _params(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise _bad("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        ids = _encode(prompt, chat=False)
        stream = _submit(ids, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            def piece(delta):
                finish = api.FINISH_REASONS.get(delta.finish_reason) if delta.finish_reason else None
                return api.completion_response(rid, model_name, delta.text, finish, None)

            def last(out):
                body_ = api.completion_response(rid, model_name, "", None, _usage(out))
                body_["choices"] = []
                return body_

            return _sse(stream, None, piece, last if include_usage else None)
        out = await _collect(stream)
        return api.completion_response(rid, model_name, out.text,
                                       api.FINISH_REASONS[out.finish_reason], _usage(out))

    def _usage(out) -> dict:
        return api.usage(out.prompt_tokens, len(out.token_ids))

    async def _collect(stream):
        try:
            return await stream.collect()
        except EngineFailed as e:
            raise APIError(503, str(e), "server_error", code="engine_failed") from None
        finally:
            stream.cancel()  # the client went away (the task was cancelled): free the slot

    def _sse(stream, first, piece, last):
        async def events():
            try:
                if first is not None:
                    yield _data(first())
                out = None
                async for delta in stream:  # one chunk per round, even without text
                    if delta.text or delta.token_ids or delta.finish_reason:
                        yield _data(piece(delta))
                    out = delta.output or out
                if last is not None and out is not None:
                    yield _data(last(out))
                yield "data: [DONE]\n\n"
            except EngineFailed as e:
                yield _data(api.error_body(str(e), "server_error", code="engine_failed"))
            finally:
                stream.cancel()  # a client that disconnects mid-stream frees its slot

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    app.include_router(v1)
    return app


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
