"""What a request must pass before the app sees it: the API key, then the size of its body.

A plain ASGI middleware, not Starlette's ``BaseHTTPMiddleware``: that one would hide a client's
disconnect from the route (its slot would not be freed). Checking here, before routing and body
parsing, is what makes a request without the key get 401 whatever its body (bad JSON included),
and what keeps a huge body from being buffered and parsed at all. It imports nothing of the
server's extra, so the command line can read its default without it.
"""

from __future__ import annotations

import hmac
import json

# Paths answered without the API key: load-balancer and orchestrator probes carry no credentials.
PUBLIC_PATHS = frozenset({"/health"})
# A request body may be this large (--max-request-bytes): room for a prompt that fills a long
# context, small enough to parse quickly on the event loop.
DEFAULT_MAX_REQUEST_BYTES = 8 << 20


class RequestGuard:
    """Answers 401 to a request without ``Authorization: Bearer <api_key>`` (every path but
    :data:`PUBLIC_PATHS`; no check when ``api_key`` is None) and 413 to a body of more than
    ``max_request_bytes`` (from ``Content-Length``, else counted while it arrives). The body of an
    accepted request is read here, then handed to the app unchanged."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        if not isinstance(max_request_bytes, int) or max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be a positive integer, got "
                             f"{max_request_bytes!r}")
        self.app = app
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()
        self.max_bytes = max_request_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.expected is not None and scope["path"] not in PUBLIC_PATHS:
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await _reply(send, 401, "missing or invalid API key", "authentication_error",
                             "invalid_api_key")
                return
        length = headers.get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.max_bytes:
                await self._too_large(send)
                return
        body = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body: nothing to answer
            size += len(message.get("body", b""))
            if size > self.max_bytes:  # chunked, no Content-Length: stop reading here
                await self._too_large(send)
                return
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(body), receive), send)

    async def _too_large(self, send):
        # the rest of the body is not read: the connection closes after the answer
        await _reply(send, 413, f"the request body is larger than this server's limit of "
                                f"{self.max_bytes} bytes", "invalid_request_error",
                     "request_too_large", close=True)


def _replay(body: bytes, receive):
    """A ``receive`` that gives the already-read body once, then the client's own messages (so
    a route still sees ``http.disconnect`` when the client leaves)."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


async def _reply(send, status: int, message: str, type_: str, code: str,
                 close: bool = False) -> None:
    """An OpenAI error body (the shape of ``openai_api.error_body``) as the whole response."""
    body = json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(body)).encode())]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
