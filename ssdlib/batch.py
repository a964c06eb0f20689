"""Offline batch generation over JSONL: input order kept, resumable, errors per record.

Records: ``{"id": ..., "prompt": "..."}`` or ``"messages": [...]`` or ``"prompt_ids": [...]``,
optionally with sampling fields (max_new_tokens, temperature, top_p, top_k, seed, stop).
Output records: ``{"id", "text", "token_ids", "finish_reason", "metrics"}`` or ``{"id", "error"}``.
The output file is rewritten atomically after each chunk, so a crash loses no finished record;
re-running skips the ids already written.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields

from ssdlib.errors import SSDError
from ssdlib.jsonl import parse_prompt_record, write_jsonl_atomic
from ssdlib.sampling import SamplingParams

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}


@dataclass
class BatchRecord:
    id: object
    prompt: object | None = None
    params: SamplingParams | None = None
    error: str | None = None


def read_records(path: str, defaults: SamplingParams) -> list[BatchRecord]:
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{os.path.basename(path)}:{n}"
            rid: object = n
            try:
                raw = json.loads(line)
                if isinstance(raw, dict) and "id" in raw:
                    rid = raw["id"]
                prompt = parse_prompt_record(line, where)
                overrides = {k: v for k, v in raw.items() if k in SAMPLING_FIELDS} \
                    if isinstance(raw, dict) else {}
                params = SamplingParams(**{**defaults.__dict__, **overrides})
                out.append(BatchRecord(rid, prompt, params))
            except ValueError as e:
                msg = str(e) if isinstance(e, SSDError) else f"{where}: malformed JSON ({e})"
                out.append(BatchRecord(rid, error=msg))
            except TypeError as e:
                out.append(BatchRecord(rid, error=f"{where}: {e}"))
    return out


def load_done(path: str) -> list[dict]:
    """Records already written by an earlier run (a torn last line is ignored)."""
    if not os.path.exists(path):
        return []
    done = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                done.append(json.loads(line))
            except ValueError:
                break
    return done


def run_batch(gen, records: list[BatchRecord], output: str, chat: bool, chunk: int,
              progress=None) -> dict:
    """Generate every record not already in ``output``; returns summary metrics."""
    done = load_done(output)
    done_ids = {json.dumps(r.get("id")) for r in done}
    todo = [r for r in records if json.dumps(r.id) not in done_ids]
    summary = {"records": len(records), "skipped_done": len(records) - len(todo), "errors": 0,
               "tokens": 0, "wall_s": 0.0}
    if progress is not None:
        progress.update(summary["skipped_done"])
    for start in range(0, len(todo), chunk):
        part = todo[start:start + chunk]
        results: dict[int, dict] = {}
        good = []
        for i, r in enumerate(part):
            if r.error is not None:
                results[i] = {"id": r.id, "error": r.error}
                continue
            try:
                gen.encode(r.prompt, chat)
                good.append(i)
            except SSDError as e:
                results[i] = {"id": r.id, "error": str(e)}
        if good:
            outs = gen.generate([part[i].prompt for i in good], [part[i].params for i in good],
                                chat=chat)
            m = gen.last_run_metrics
            summary["tokens"] += m["tokens"]
            summary["wall_s"] += m["wall_s"]
            for i, o in zip(good, outs):
                results[i] = {"id": part[i].id, "text": o.text, "token_ids": o.token_ids,
                              "finish_reason": o.finish_reason, "metrics": o.metrics}
        done += [results[i] for i in range(len(part))]
        write_jsonl_atomic(output, done)
        summary["errors"] += sum("error" in results[i] for i in range(len(part)))
        if progress is not None:
            progress.update(len(part))
            if summary["wall_s"]:
                progress.set_postfix(tok_s=f"{summary['tokens'] / summary['wall_s']:.1f}")
    summary["tok_s"] = summary["tokens"] / summary["wall_s"] if summary["wall_s"] else 0.0
    return summary
