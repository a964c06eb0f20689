"""``python -m ssdlib.generate`` / ``torchrun --nproc_per_node N -m ssdlib.generate``.

Generates for one or more prompts, streams text to stdout (one prompt) or prints each answer,
and optionally writes JSONL records (--output) and a metrics JSON (--metrics-json).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys

import torch

from ssdlib.cli_args import (add_engine_args, add_sampling_args, engine_kwargs, run_reporting,
                             sampling_params)
from ssdlib.generator import Generator
from ssdlib.jsonl import check_writable, read_prompts_file, write_json, write_jsonl_atomic
from ssdlib.log import setup_logging
from ssdlib.quick_exit import quick_exit

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ssdlib.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts-file", default=None,
                   help="prompts: .jsonl (prompt / messages / prompt_ids per line) or text lines")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    add_engine_args(p)
    add_sampling_args(p)
    p.add_argument("--output", default=None, help="write one JSON record per prompt here")
    p.add_argument("--metrics-json", default=None, help="write run metrics here")
    p.add_argument("--no-stream", action="store_true", help="print answers when complete")
    p.add_argument("--log-level", default="WARNING")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def machine_info(args) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__,
            "host": platform.node(), "cpu_count": os.cpu_count()}
    if args.device != "cpu" and torch.cuda.is_available():  # "auto" resolves to cuda
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def capture_batch(n_prompts: int, max_batch: int) -> int:
    """The engine's batch for ``n_prompts`` prompts under --max-batch: never more rows run at
    once than there are prompts, so the steps are captured (and compiled) for the batch buckets
    up to min(n_prompts, max_batch) only (one prompt: bucket 1), and the KV cache holds that
    many slots."""
    return min(n_prompts, max_batch)


def run(args) -> int:
    # everything that can be checked without the models, before any model loads
    params = sampling_params(args)
    for flag, path in (("--output", args.output), ("--metrics-json", args.metrics_json)):
        if path:
            check_writable(path, flag)
    prompts = list(args.prompt)
    if args.prompts_file:
        prompts += read_prompts_file(args.prompts_file)
    if not prompts:
        prompts = [DEFAULT_PROMPT]
    engine = engine_kwargs(args)
    engine["max_batch"] = capture_batch(len(prompts), args.max_batch)
    with Generator(log_level=args.log_level, start=False, **engine) as gen:
        gen.validate(prompts, params, chat=args.chat)
        # the prompts are the whole work: compile auto decides on them, the warm-up runs them
        gen.start(prompts, params, chat=args.chat)
        if not gen.is_leader:
            return 0
        stream = len(prompts) == 1 and not args.no_stream
        on_text = (lambda i, d: (sys.stdout.write(d), sys.stdout.flush())) if stream else None
        outputs = gen.generate(prompts, params, chat=args.chat, on_text=on_text)
        if stream:
            sys.stdout.write("\n")
        else:
            for o in outputs:
                sys.stdout.write(f"--- [{o.index}] ---\n{o.text}\n")
        m = gen.last_run_metrics
    sys.stderr.write(f"[ssdlib] mode={args.mode} device={gen.cfg.device} "
                     f"dtype={gen.cfg.torch_dtype_name} tokens={m['tokens']} "
                     + (f"ready_s={m['ready_s']:.1f} " if "ready_s" in m else "")
                     + f"decode_tok_s={m['decode_tok_s']:.1f}"
                     + (f" acceptance_rate={m['acceptance_rate']:.3f}"
                        if "acceptance_rate" in m else "")
                     + (f" mean_k={m['mean_k']:.2f} k0_rounds={m['k0_rounds']}"
                        if "mean_k" in m else "")
                     + (f" hit_rate={m['hit_rate']:.3f}" if "hit_rate" in m else "") + "\n")
    if args.output:
        write_jsonl_atomic(args.output, [
            {"id": o.index, "text": o.text, "token_ids": o.token_ids,
             "finish_reason": o.finish_reason, "metrics": o.metrics} for o in outputs])
    if args.metrics_json:
        write_json(args.metrics_json, {"run": m, "outputs": [o.metrics for o in outputs],
                                       "args": vars(args), "machine": machine_info(args),
                                       "command": " ".join(sys.argv)})
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    setup_logging(args.log_level)
    return run_reporting(run, args)


if __name__ == "__main__":
    quick_exit(main())
