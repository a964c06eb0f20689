"""Interactive multi-turn chat: ``python -m ssdlib.chat [generate flags] [--metrics]``.

Reads a user turn per line from stdin (``/exit`` or EOF ends), streams the answer, keeps the
conversation in the chat template.
"""

from __future__ import annotations

import argparse
import sys

from ssdlib.cli_args import add_engine_args, add_sampling_args, engine_kwargs, sampling_params
from ssdlib.errors import SSDError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ssdlib.chat", description=__doc__)
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--metrics", action="store_true", help="print tok/s, acceptance, hit rate")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    try:
        from ssdlib.generator import Generator

        params = sampling_params(args)
        with Generator(**engine_kwargs(args)) as gen:
            messages = [{"role": "system", "content": args.system}] if args.system else []
            interactive = sys.stdin.isatty()
            while True:
                if interactive:
                    sys.stdout.write("> ")
                    sys.stdout.flush()
                line = sys.stdin.readline()
                if not line or line.strip() == "/exit":
                    return 0
                if not line.strip():
                    continue
                messages.append({"role": "user", "content": line.rstrip("\n")})
                pieces = []

                def show(_i, delta):
                    pieces.append(delta)
                    sys.stdout.write(delta)
                    sys.stdout.flush()

                gen.generate([{"messages": list(messages)}], params, on_text=show)
                sys.stdout.write("\n")
                messages.append({"role": "assistant", "content": "".join(pieces)})
                if args.metrics:
                    m = gen.last_run_metrics
                    extra = "".join(f" {k}={m[k]:.3f}" for k in ("acceptance_rate", "hit_rate")
                                    if k in m)
                    sys.stdout.write(f"[{m['tokens']} tokens, {m['decode_tok_s']:.1f} tok/s{extra}]\n")
                sys.stdout.flush()
    except SSDError as e:
        if args.debug:
            raise
        sys.stderr.write(f"ssdlib error: {str(e).splitlines()[0]}\n")
        return 2


if __name__ == "__main__":
    sys.exit(main())
