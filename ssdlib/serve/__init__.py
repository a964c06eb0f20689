"""Serving: an asyncio front end on the engine (``AsyncEngine``) and an OpenAI-compatible HTTP
server on it (``python -m ssdlib.serve``; needs ``pip install -e ".[serve]"``).

- ``async_engine.py``  requests join the running batch, stream deltas, cancel, bounded queue
- ``openai_api.py``    the OpenAI request bodies (pydantic) and response / error bodies
- ``app.py``           the FastAPI app: routes, SSE streaming, errors
- ``lifecycle.py``     start-up (503 until warm) and the graceful stop (drain, then cancel)
- ``warmup.py``        the requests run through the engine before it serves
- ``guard.py``         what a request passes first: the API key, the body's size
- ``metrics.py``       Prometheus metrics of the server
- ``__main__.py``      the command line
"""

from ssdlib.serve.async_engine import AsyncEngine, Delta, EngineFailed, QueueFull

__all__ = ["AsyncEngine", "Delta", "EngineFailed", "QueueFull"]
