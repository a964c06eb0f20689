"""``python -m ssdlib.serve``: an OpenAI-compatible HTTP server (``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``) on the engine.

Takes the engine flags of ``python -m ssdlib.generate`` (``--mode``, ``--target``, ``--draft``,
``--tp``, ...). Requests join the running batch. Binds 127.0.0.1 unless ``--host`` says
otherwise; with ``--api-key`` every request but ``/health`` (``/v1``, ``/metrics``, the API docs)
must carry ``Authorization: Bearer KEY``. A request body over ``--max-request-bytes`` gets 413.
Under torchrun rank 0 serves and the other ranks run their roles as usual.

Start-up logs one line per phase (models, warm-up, then "ssdlib server ready: listening on
http://HOST:PORT"); ``/health`` answers 503 until the warm-up has run every batch shape through
the engine (``ssdlib.serve.warmup``; ``--no-warmup`` skips it). SIGTERM or SIGINT stops the
server gracefully: new requests get 503, those in flight get ``--shutdown-timeout`` seconds to
finish, then the rest are cancelled (each stream ends with finish reason "abort"), every rank
stops and the server exits 0; a second SIGINT stops at once. Exits non-zero if a rank fails,
or if requests are in flight and the engine delivers nothing for ``--stall-timeout`` seconds (a
rank alive but stuck).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from ssdlib import env
from ssdlib.cli_args import add_engine_args, engine_kwargs, report_error, run_reporting
from ssdlib.errors import EXIT_FAILURE, ConfigError
from ssdlib.generator import Generator
from ssdlib.log import progress_logger, setup_logging
from ssdlib.serve.guard import DEFAULT_MAX_REQUEST_BYTES
from ssdlib.serve.warmup import run_warmup

progress = progress_logger()

# a served engine sits idle between requests: its ranks must not time out waiting
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
# no token for this long while serving: a stuck rank (a step, even a capture, takes seconds)
DEFAULT_STALL_TIMEOUT_S = 600.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ssdlib.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-queue", type=int, default=64,
                   help="requests waiting beyond --max-batch; more are refused with 503")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' (default: the SSDLIB_API_KEY "
                        "environment variable, else none)")
    g.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="the largest request body accepted; larger ones get 413 "
                        f"(default: {DEFAULT_MAX_REQUEST_BYTES} = 8 MiB)")
    g.add_argument("--served-model-name", default=None,
                   help="the model id clients use (default: the target's name)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds the requests in flight get to finish after SIGTERM / SIGINT "
                        "before they are cancelled (default: 30)")
    g.add_argument("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT_S,
                   help="with requests in flight and no token for this many seconds the engine "
                        "counts as stuck: the requests fail, the server exits non-zero "
                        f"(default: {DEFAULT_STALL_TIMEOUT_S:g}; 0: never)")
    g.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="serve without warming up: the first requests of each batch size then "
                        "wait while their steps are captured (seconds on a GPU)")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class _StopRequested(BaseException):
    """SIGTERM while the models load: the server stops as it would once serving (exit 0)."""


def _raise_stop(signum, frame):
    raise _StopRequested()


def _server_class(uvicorn):
    class Server(uvicorn.Server):
        """uvicorn's server with the graceful stop of ``ssdlib.serve.lifecycle``: the first
        SIGTERM / SIGINT drains the requests in flight (uvicorn would stop the engine under
        them, and re-raise the signal afterwards, killing the process before its ranks are
        stopped); a signal during the drain stops without waiting for it."""

        lifecycle = None

        def handle_exit(self, sig, frame):
            if self.lifecycle is not None and not self.lifecycle.stopping:
                self.lifecycle.request_stop()
                return
            # a signal during the stop: uvicorn's own stop (a SIGINT after that: at once)
            self.force_exit = self.should_exit and sig == signal.SIGINT
            self.should_exit = True

        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started and self.servers and self.lifecycle is not None:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                host = f"[{host}]" if ":" in host else host
                self.lifecycle.listening(f"http://{host}:{port}")

    return Server


def run(args) -> int:
    # fastapi and uvicorn are the optional serve extra: imported here so that a missing extra is
    # one clear error, not an ImportError of the module
    try:
        import uvicorn

        from ssdlib.serve.app import create_app
    except ImportError as e:
        sys.stderr.write(f"ssdlib error: the server needs its extra: pip install -e \".[serve]\" "
                         f"({e})\n")
        return 2

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    if not args.shutdown_timeout >= 0:
        raise ConfigError(f"--shutdown-timeout must be >= 0 seconds, got {args.shutdown_timeout}")
    if not args.stall_timeout >= 0 or args.stall_timeout == float("inf"):
        raise ConfigError(f"--stall-timeout must be a finite number of seconds >= 0 (0: never), "
                          f"got {args.stall_timeout}")
    api_key = args.api_key or env.text("SSDLIB_API_KEY")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.target))
    failed: list[BaseException] = []
    server = None
    # until uvicorn takes the signals over (and after it hands them back)
    previous = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        with Generator(log_level=args.log_level, timeout_s=IDLE_TIMEOUT_S, start=False,
                       **engine_kwargs(args)) as gen:
            gen.start(warm=False)  # the models load; the warm-up runs while the server listens
            if not gen.is_leader:
                return 0

            def on_failure(error):
                failed.append(error)
                server.should_exit = True

            def on_stopped():
                server.should_exit = True

            warmup = (lambda stop: run_warmup(gen, stop=stop)) if args.warmup else None
            app = create_app(gen, name, args.max_queue, api_key, on_failure,
                             max_request_bytes=args.max_request_bytes, warmup=warmup,
                             shutdown_timeout_s=args.shutdown_timeout, on_stopped=on_stopped,
                             stall_timeout_s=args.stall_timeout or None)
            server = _server_class(uvicorn)(uvicorn.Config(
                app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                timeout_graceful_shutdown=5))
            server.lifecycle = app.state.lifecycle
            server.run()
            signal.signal(signal.SIGTERM, previous)
            if failed:
                gen.abort()
            else:
                progress.info("stopping the engine")
    except _StopRequested:
        progress.info("stopped while starting")
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    if failed:
        report_error(failed[0])
        return EXIT_FAILURE
    if server is not None and server.started:
        progress.info("stopped")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    return run_reporting(run, args)


if __name__ == "__main__":
    sys.exit(main())
