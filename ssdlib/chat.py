"""Interactive multi-turn chat: ``python -m ssdlib.chat [generate flags] [--metrics]``.

Reads a user turn per line from stdin (``/exit`` or EOF ends), streams the answer, keeps the
conversation in the chat template. When the conversation outgrows the context (``--max-len``),
the oldest turns are dropped (it says so on stderr); a message too long on its own is refused and
the session goes on. Ctrl-C after Enter stops that answer (what came so far stays in the
conversation); Ctrl-C at the prompt exits.
"""

from __future__ import annotations

import argparse
import sys

from ssdlib.cli_args import (add_engine_args, add_sampling_args, engine_kwargs, report_error,
                            run_reporting, sampling_params)
from ssdlib.errors import ConfigError, RankFailure, SSDError
from ssdlib.generator import Generator
from ssdlib.sampling import SamplingParams


def fit_conversation(gen, messages: list[dict], params: SamplingParams) -> tuple[list[dict], int]:
    """``messages`` (an optional system message, then user/assistant turns ending with the new
    user message) with the oldest exchanges dropped until the prompt leaves room for a full
    answer (``max_new_tokens``), or only the new message is left. Returns the messages and how
    many exchanges were dropped; raises ConfigError if the new message does not fit at all."""
    system = messages[:1] if messages and messages[0].get("role") == "system" else []
    turns = messages[len(system):]
    dropped = 0
    while True:
        ids = gen.encode({"messages": system + turns})
        if len(ids) + params.max_new_tokens < gen.max_context or len(turns) <= 1:
            break
        turns = turns[2:] if len(turns) > 2 else turns[-1:]  # one user + assistant exchange
        dropped += 1
    if not gen.prompts.fits(ids):
        raise ConfigError(f"this message makes a prompt of {len(ids)} tokens, more than the "
                          f"context allows ({gen.max_context} tokens incl. the answer; see "
                          "--max-len); it was not sent")
    return system + turns, dropped


def chat(args) -> int:
    params = sampling_params(args)
    with Generator(start=False, **engine_kwargs(args)) as gen:
        if gen.tokenizer is None or gen.tokenizer.chat_template is None:
            raise ConfigError(f"{args.target} has no chat template; chat needs one")
        messages = [{"role": "system", "content": args.system}] if args.system else []
        gen.validate({"messages": messages + [{"role": "user", "content": "Hello"}]}, params)
        gen.start()
        interactive = sys.stdin.isatty()
        while True:
            if interactive:
                sys.stdout.write("> ")
                sys.stdout.flush()
            line = None
            pieces: list[str] = []
            try:
                line = sys.stdin.readline()
                if not line or line.strip() == "/exit":
                    return 0
                if line.strip():
                    messages = answer(gen, args, params, messages, line.rstrip("\n"), pieces)
            except KeyboardInterrupt:
                if line is None:  # at the prompt: end the session (exit 130)
                    raise
                # from Enter on, a Ctrl-C stops this answer only, wherever it lands (the
                # Generator keeps itself in step with its ranks), and the session goes on
                sys.stdout.write("\n[interrupted]\n")
                sys.stdout.flush()
                if pieces:  # what came so far is kept; a turn with no answer is dropped
                    messages = messages + [{"role": "user", "content": line.rstrip("\n")},
                                           {"role": "assistant", "content": "".join(pieces)}]


def answer(gen, args, params: SamplingParams, messages: list[dict], text: str,
           pieces: list[str]) -> list[dict]:
    """Send the user message ``text`` after ``messages`` and stream the answer, collecting its
    pieces in ``pieces``; returns the conversation with this exchange added (and old ones
    dropped if it outgrew the context), or ``messages`` unchanged if the message was refused."""
    try:
        turn, dropped = fit_conversation(gen, messages + [{"role": "user", "content": text}],
                                         params)
    except SSDError as e:  # this message only: the session goes on
        report_error(e)
        return messages
    if dropped:
        sys.stderr.write(f"[ssdlib] the conversation outgrew --max-len {args.max_len}: "
                         f"dropped the {dropped} oldest exchange(s)\n")

    def show(_i, delta):
        pieces.append(delta)
        sys.stdout.write(delta)
        sys.stdout.flush()

    try:
        gen.generate([{"messages": list(turn)}], params, on_text=show)
    except RankFailure:
        raise
    except SSDError as e:  # this message only
        report_error(e)
        return messages
    sys.stdout.write("\n")
    if args.metrics:
        m = gen.last_run_metrics
        extra = "".join(f" {k}={m[k]:.3f}" for k in ("acceptance_rate", "hit_rate") if k in m)
        sys.stdout.write(f"[{m['tokens']} tokens, {m['decode_tok_s']:.1f} tok/s{extra}]\n")
    sys.stdout.flush()
    return turn + [{"role": "assistant", "content": "".join(pieces)}]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ssdlib.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--metrics", action="store_true", help="print tok/s, acceptance, hit rate")
    p.add_argument("--debug", action="store_true")
    return p


def main(argv=None) -> int:
    return run_reporting(chat, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
