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
                             sampling_params)
from ssdlib.errors import ConfigError, SSDError  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--input", required=True)
    p.add_argument("--output", required=True)
    p.add_argument("--chat", action="store_true")
    p.add_argument("--chunk", type=int, default=64, help="records per checkpointed chunk")
    p.add_argument("--summary-json", default=None)
    p.add_argument("--debug", action="store_true")
    add_engine_args(p)
    add_sampling_args(p)
    args = p.parse_args(argv)
    try:
        from tqdm import tqdm

        from ssdlib.batch import read_records, run_batch
        from ssdlib.generator import Generator

        if not os.path.exists(args.input):
            raise ConfigError(f"--input {args.input}: no such file")
        records = read_records(args.input, sampling_params(args))
        with Generator(**engine_kwargs(args)) as gen, \
                tqdm(total=len(records), unit="rec", file=sys.stderr) as bar:
            summary = run_batch(gen, records, args.output, args.chat, args.chunk, bar)
    except SSDError as e:
        if args.debug:
            raise
        sys.stderr.write(f"ssdlib error: {str(e).splitlines()[0]}\n")
        return 2
    sys.stderr.write("[ssdlib] " + json.dumps(summary) + "\n")
    if args.summary_json:
        with open(args.summary_json, "w") as f:
            json.dump(summary, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
