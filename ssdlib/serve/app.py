"""The FastAPI app: OpenAI-compatible routes on an :class:`AsyncEngine`.

Errors are OpenAI error bodies: 400 a bad field, 401 a missing or wrong API key (checked first,
on every path but ``/health``), 404 an unknown model or route, 413 a body over
``max_request_bytes`` or a prompt longer than the context, 503 the queue is full, the engine
failed, or the server is warming up or shutting down (:mod:`ssdlib.serve.lifecycle`). A bad
request never reaches the engine. Bodies say what the client can act on; internals
(tracebacks, paths) go to the server's log only. When the engine fails, ``/health`` answers 503
and ``on_engine_failure`` is called (the CLI stops the server and exits non-zero).

The event loop serves every stream, so nothing slow runs on it: prompts are tokenized and chat
templates rendered on worker threads, and a body's size and shape are bounded
(:mod:`ssdlib.serve.guard`, :mod:`ssdlib.serve.openai_api`) before it is validated there. A
client that disconnects, streaming or not, frees its slot.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from contextlib import asynccontextmanager
from typing import Callable

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssdlib.errors import SSDError
from ssdlib.log import get_logger
from ssdlib.sampling import SamplingParams
from ssdlib.serve import openai_api as api
from ssdlib.serve.async_engine import AsyncEngine, EngineFailed, QueueFull
from ssdlib.serve.guard import DEFAULT_MAX_REQUEST_BYTES, RequestGuard
from ssdlib.serve.lifecycle import READY, STARTING, ServerLifecycle
from ssdlib.serve.metrics import ServerMetrics
from ssdlib.tokenizer.chat_template import MAX_OUTPUT_CHARS

logger = get_logger(__name__)

# How often a non-streaming request checks that its client is still there.
DISCONNECT_POLL_S = 0.25
# What a client is told when the engine failed; the cause (often a rank's traceback) is logged.
ENGINE_FAILED = "the engine failed and this server is stopping; see the server log"
# pydantic names the member of a union in an error's location ("str", "list[TextPart]")
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|\w+\[.*\])$")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, api.error_body(message, type_, param, code)


def _bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param)


def create_app(generator, model_name: str, max_queue: int = 64, api_key: str | None = None,
               on_engine_failure=None,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               warmup: Callable | None = None, shutdown_timeout_s: float = 30.0,
               on_stopped: Callable[[], None] | None = None,
               stall_timeout_s: float | None = None) -> FastAPI:
    """The app serving ``generator`` (started, leader rank) as ``model_name``; the engine
    starts and stops with the app's lifespan. With ``api_key``, every path but ``/health``
    needs ``Authorization: Bearer <api_key>``.

    ``warmup(stop)`` (e.g. :func:`ssdlib.serve.warmup.run_warmup`) runs on a worker thread
    before the engine serves; until it ends ``/health`` and every request answer 503.
    ``app.state.lifecycle.request_stop()`` begins a graceful stop (:mod:`lifecycle`), which
    calls ``on_stopped`` when the requests in flight are done. ``stall_timeout_s``: requests in
    flight and nothing delivered for that long fail the engine as a rank's crash does
    (:meth:`AsyncEngine.check_progress`; None: never)."""
    metrics = ServerMetrics({"mode": generator.cfg.mode, "model": model_name,
                             "max_batch": str(generator.cfg.max_batch)})
    engine = AsyncEngine(generator, max_queue, metrics, stall_timeout_s)
    metrics.bind(engine)
    lifecycle = ServerLifecycle(engine, warmup, shutdown_timeout_s, on_stopped)
    max_context = generator.max_context
    prompts = generator.prompts  # its tokenizer encodes without holding the GIL

    @asynccontextmanager
    async def lifespan(app):
        await lifecycle.start()
        watch = asyncio.create_task(_watch())
        yield
        watch.cancel()
        await lifecycle.close()

    async def _watch():
        while engine.failure is None:
            await asyncio.sleep(0.2)
            engine.check_progress()
        logger.error("the engine failed: %s", engine.failure)
        if on_engine_failure is not None:
            on_engine_failure(engine.failure)

    app = FastAPI(title="ssdlib", lifespan=lifespan)
    app.state.engine = engine
    app.state.lifecycle = lifecycle
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)

    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return JSONResponse(exc.body, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        message, param = _validation_message(exc.errors())
        return JSONResponse(api.error_body(message, "invalid_request_error", param),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(api.error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):
        # a bug: the client gets no traceback; the server logs it (Starlette re-raises the
        # exception after this answer for that)
        return JSONResponse(api.error_body("internal server error; see the server log",
                                           "server_error"), status_code=500)

    v1 = APIRouter(prefix="/v1")

    @app.get("/health")
    async def health():
        if engine.failure is not None:  # the cause is in the server's log, not for any caller
            return JSONResponse({"status": "failed", "error": "the engine failed"},
                                status_code=503)
        if lifecycle.phase != READY:  # warming up, or stopping
            return JSONResponse({"status": lifecycle.phase}, status_code=503)
        if not engine.healthy:
            return JSONResponse({"status": "failed", "error": "the engine is not serving"},
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
            # validated here, so that a value the engine would refuse is this request's 400
            # and never an error on the engine's thread; the engine cuts an answer to the
            # context anyway, a bound here keeps absurd numbers (2**70) out of it
            return SamplingParams(max_new_tokens=min(max_tokens or max_context, max_context),
                                  temperature=temperature,
                                  top_p=1.0 if body.top_p is None else body.top_p,
                                  top_k=body.top_k or 0, seed=body.seed, stop=stop,
                                  ignore_eos=body.ignore_eos).validate()
        except Exception as e:
            raise _refused(e) from None

    def _encode(prompt, chat: bool) -> list[int]:
        """Token ids of a prompt; on a worker thread (see the module docstring)."""
        param = "messages" if chat else "prompt"
        if chat:
            chars = sum(len(m["content"]) for m in prompt["messages"])
            if chars > MAX_OUTPUT_CHARS:  # the template would stop: say why before rendering
                raise APIError(413, f"the messages hold {chars} characters; the chat template "
                                    f"renders at most {MAX_OUTPUT_CHARS}",
                               "invalid_request_error", param, "context_length_exceeded")
        try:
            ids = prompts.encode(prompt, chat=chat)
        except Exception as e:
            raise _refused(e, param) from None
        if not prompts.fits(ids):
            raise APIError(413, f"the prompt has {len(ids)} tokens; this server's context is "
                                f"{max_context} tokens including the answer",
                           "invalid_request_error", param, "context_length_exceeded")
        return ids

    def _submit(ids, params):
        if not lifecycle.accepting and engine.failure is None:
            starting = lifecycle.phase == STARTING
            raise APIError(503, "the server is warming up; retry shortly" if starting
                           else "the server is shutting down", "server_error",
                           code="warming_up" if starting else "shutting_down")
        try:
            return engine.submit(ids, params)
        except QueueFull as e:
            raise APIError(503, str(e), "server_overloaded", code="queue_full") from None
        except EngineFailed:
            raise APIError(503, ENGINE_FAILED, "server_error", code="engine_failed") from None
        except Exception as e:
            raise _refused(e) from None

    @v1.post("/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request):
        params = _params(body, body.max_completion_tokens or body.max_tokens)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        ids = await asyncio.to_thread(_encode, {"messages": messages}, True)
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
        out = await _collect(stream, request)
        if out is None:
            return _gone()
        return api.chat_response(rid, model_name, out.text,
                                 api.FINISH_REASONS[out.finish_reason], _usage(out))

    @v1.post("/completions")
    async def completions(body: api.CompletionRequest, request: Request):
        params = _params(body, body.max_tokens)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise _bad("only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        ids = await asyncio.to_thread(_encode, prompt, False)
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
        out = await _collect(stream, request)
        if out is None:
            return _gone()
        return api.completion_response(rid, model_name, out.text,
                                       api.FINISH_REASONS[out.finish_reason], _usage(out))

    def _usage(out) -> dict:
        return api.usage(out.prompt_tokens, len(out.token_ids))

    async def _collect(stream, request: Request):
        """The request's Output, or None if its client disconnected first (the request is
        cancelled: the server does not cancel a route when its client leaves, so without this
        an abandoned request would hold its slot to the end)."""
        result = asyncio.ensure_future(stream.collect())
        try:
            while True:
                done, _ = await asyncio.wait({result}, timeout=DISCONNECT_POLL_S)
                if done:
                    return result.result()
                if await request.is_disconnected():
                    return None
        except EngineFailed:
            raise APIError(503, ENGINE_FAILED, "server_error", code="engine_failed") from None
        finally:
            stream.cancel()  # a no-op once the request ended
            result.cancel()

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
            except EngineFailed:
                yield _data(api.error_body(ENGINE_FAILED, "server_error", code="engine_failed"))
            finally:
                stream.cancel()  # a client that disconnects mid-stream frees its slot

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    app.include_router(v1)
    return app


def _data(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _gone() -> Response:
    """The answer to a client that left; nobody reads it (499: nginx's "client closed
    request")."""
    return Response(status_code=499)


def _refused(error: Exception, param: str | None = None) -> APIError:
    """The 400 for an error raised while preparing one request. An :class:`SSDError` (a bad
    prompt, a template that refuses the conversation) speaks to the client; anything else is
    logged with its traceback and named only by its type."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, SSDError):
        return _bad(str(error), param)
    logger.warning("request refused: %s: %s", type(error).__name__, error,
                   exc_info=(type(error), error, error.__traceback__))
    return _bad(f"the request could not be prepared ({type(error).__name__})", param)


def _validation_message(errors: list) -> tuple[str, str | None]:
    """(message, param) of pydantic's errors for a body. A union reports one error per member;
    the most telling is a constraint broken (too long, not 'text') rather than a type that did
    not match, and then the one that got deepest into the body."""
    if not errors:
        return "invalid request body", None
    err = max(errors, key=lambda e: (not str(e.get("type", "")).endswith("_type"),
                                     len(e.get("loc", ()))))
    if err.get("type") == "json_invalid":
        return f"the body is not valid JSON: {err.get('ctx', {}).get('error', '')}", None
    if tuple(err.get("loc", ())) == ("body",):  # not an object, or not sent as JSON
        return "the body must be a JSON object, sent as application/json", None
    loc = [str(x) for x in err.get("loc", ())
           if x != "body" and not _UNION_MEMBER.match(str(x))]
    msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
    param = ".".join(loc) or None
    return (f"{param}: {msg}" if param else msg), param
