"""``python -m ssdlib.serve``: an OpenAI-compatible HTTP server (``/v1/chat/completions``,
``/v1/completions``, ``/v1/models``, ``/health``, ``/metrics``) on the engine.

Takes the engine flags of ``python -m ssdlib.generate`` (``--mode``, ``--target``, ``--draft``,
``--tp``, ...). Requests join the running batch. Binds 127.0.0.1 unless ``--host`` says
otherwise; with ``--api-key`` every request but ``/health`` (``/v1``, ``/metrics``, the API docs)
must carry ``Authorization: Bearer KEY``. A request body over ``--max-request-bytes`` gets 413.
Under torchrun rank 0 serves and the other ranks run their roles as usual. Exits non-zero if a
rank fails.
"""

from __future__ import annotations

import argparse
import os
import sys

from ssdlib.cli_args import add_engine_args, engine_kwargs, report_error, run_reporting
from ssdlib.errors import EXIT_FAILURE, ConfigError
from ssdlib.log import setup_logging
from ssdlib.serve.guard import DEFAULT_MAX_REQUEST_BYTES

# a served engine sits idle between requests: its ranks must not time out waiting
IDLE_TIMEOUT_S = 7 * 24 * 3600.0


def parse_args(argv=None) -> argparse.Namespace:
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
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p.parse_args(argv)


def run(args) -> int:
    try:
        import uvicorn

        from ssdlib.serve.app import create_app
    except ImportError as e:
        sys.stderr.write(f"ssdlib error: the server needs its extra: pip install -e \".[serve]\" "
                         f"({e})\n")
        return 2
    from ssdlib.generator import Generator

    if args.max_queue < 0:
        raise ConfigError(f"--max-queue must be >= 0, got {args.max_queue}")
    if args.max_request_bytes < 1:
        raise ConfigError(f"--max-request-bytes must be >= 1, got {args.max_request_bytes}")
    api_key = args.api_key or os.environ.get("SSDLIB_API_KEY") or None
    name = args.served_model_name or os.path.basename(os.path.normpath(args.target))
    failed: list[BaseException] = []
    with Generator(log_level=args.log_level, timeout_s=IDLE_TIMEOUT_S,
                   **engine_kwargs(args)) as gen:
        if not gen.is_leader:
            return 0
        server = None

        def on_failure(error):
            failed.append(error)
            server.should_exit = True

        app = create_app(gen, name, args.max_queue, api_key, on_failure,
                         max_request_bytes=args.max_request_bytes)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level=args.log_level.lower(),
                                               timeout_graceful_shutdown=5))
        server.run()
        if failed:
            gen.abort()
    if failed:
        report_error(failed[0])
        return EXIT_FAILURE
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    return run_reporting(run, args)


if __name__ == "__main__":
    sys.exit(main())
