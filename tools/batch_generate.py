"""Batch offline generation: ``python tools/batch_generate.py --input in.jsonl --output out.jsonl``
plus any ``ssdlib.generate`` engine/sampling flag. See ``ssdlib/batch.py`` for the record format.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ssdlib.cli_args import (add_engine_args, add_sampling_args, engine_kwargs,  # noqa: E402
                             run_reporting, sampling_params)
from ssdlib.errors import ConfigError  # noqa: E402
from ssdlib.quick_exit import quick_exit  # noqa: E402


def run(args) -> int:
    from tqdm import tqdm

    from ssdlib.batch import read_records, run_batch
    from ssdlib.generator import Generator
    from ssdlib.jsonl import check_writable, write_json

    # everything that can be checked without the models, before any model loads
    params = sampling_params(args)
    if not os.path.exists(args.input):
        raise ConfigError(f"--input {args.input}: no such file")
    if os.path.exists(args.output) and os.path.samefile(args.input, args.output):
        # the output is rewritten after every chunk: it would replace the records being read
        # (and a rerun would take the input records for finished ones)
        raise ConfigError(f"--output {args.output} is the --input file; choose another path "
                          "for the output")
    for flag, path in (("--output", args.output), ("--summary-json", args.summary_json)):
        if path:
            check_writable(path, flag)
    if args.chunk < 1:
        raise ConfigError(f"--chunk must be >= 1, got {args.chunk}")
    records = read_records(args.input, params)
    # the ranks start at the first chunk with work to do
    with Generator(start=False, **engine_kwargs(args)) as gen, \
            tqdm(total=len(records), unit="rec", file=sys.stderr) as bar:
        summary = run_batch(gen, records, args.output, args.chat, args.chunk, bar)
    sys.stderr.write("[ssdlib] " + json.dumps(summary) + "\n")
    if args.summary_json:
        write_json(args.summary_json, summary)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--chunk", type=int, default=64, help="records per checkpointed chunk")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--debug", action="store_true")
    add_engine_args(p)
    add_sampling_args(p)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_reporting(run, args, note="finished records are saved; rerun to resume")


if __name__ == "__main__":
    quick_exit(main())
