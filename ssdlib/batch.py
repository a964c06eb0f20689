"""Offline batch generation over JSONL: input order kept, resumable, errors per record.

Records: ``{"id": ..., "prompt": "..."}`` or ``"messages": [...]`` or ``"prompt_ids": [...]``
(exactly one), optionally with sampling fields (max_new_tokens, temperature, top_p, top_k, seed,
stop, ignore_eos); any other field is an error. ``id`` is a string or an integer, unique in the
file. Output records, in input order: ``{"id", "text", "token_ids", "finish_reason", "metrics"}``
or ``{"id", "error"}``; a record without an id (or too malformed to read one) has ``"id": null``
and its 1-based ``"line"``, so no id is ever invented. The output file is rewritten atomically
after each chunk, so a crash loses no finished record; re-running skips the finished records and
retries the error records (an input fixed since then is generated).
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, fields

from ssdlib.errors import ConfigError, SSDError
from ssdlib.jsonl import decode_line, prompt_from_record, write_jsonl_atomic
from ssdlib.sampling import SamplingParams

SAMPLING_FIELDS = {f.name for f in fields(SamplingParams)}
RECORD_FIELDS = {"id", "prompt", "messages", "prompt_ids"} | SAMPLING_FIELDS


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# JSON types of the sampling fields (SamplingParams checks the ranges)
_FIELD_TYPES = {
    "max_new_tokens": ("an integer", _is_int),
    "top_k": ("an integer", _is_int),
    "seed": ("an integer or null", lambda v: v is None or _is_int(v)),
    "temperature": ("a number", lambda v: _is_int(v) or isinstance(v, float)),
    "top_p": ("a number", lambda v: _is_int(v) or isinstance(v, float)),
    "stop": ("a string or a list of strings",
             lambda v: isinstance(v, str) or isinstance(v, list) and all(
                 isinstance(s, str) for s in v)),
    "ignore_eos": ("true or false", lambda v: isinstance(v, bool)),
}


@dataclass
class BatchRecord:
    id: object  # the record's own id, or None
    line: int  # 1-based line in the input file
    prompt: object | None = None
    params: SamplingParams | None = None
    error: str | None = None

    @property
    def key(self) -> tuple:
        """What identifies the record across runs: its id, else its line."""
        return ("id", json.dumps(self.id)) if self.id is not None else ("line", self.line)

    def result(self, **fields) -> dict:
        head = {"id": self.id} if self.id is not None else {"id": None, "line": self.line}
        return {**head, **fields}


def output_key(rec: dict) -> tuple | None:
    """The :attr:`BatchRecord.key` of an output record."""
    if rec.get("id") is not None:
        return ("id", json.dumps(rec["id"]))
    return ("line", rec["line"]) if isinstance(rec.get("line"), int) else None


def _parse(raw: object, where: str, line: int, defaults: SamplingParams) -> BatchRecord:
    if not isinstance(raw, dict):
        return BatchRecord(None, line, prompt_from_record(raw, where), defaults)
    rid = raw.get("id")
    if rid is not None and not (isinstance(rid, str) or _is_int(rid)):
        return BatchRecord(None, line, error=f"{where}: 'id' must be a string or an integer, "
                                             f"got {json.dumps(rid)}")
    rec = BatchRecord(rid, line)
    unknown = sorted(k for k in raw if k not in RECORD_FIELDS)
    if unknown:
        close = difflib.get_close_matches(unknown[0], sorted(RECORD_FIELDS), n=1)
        rec.error = (f"{where}: unknown field {unknown[0]!r}"
                     + (f" (did you mean {close[0]!r}?)" if close else "")
                     + f"; known fields: {', '.join(sorted(RECORD_FIELDS))}")
        return rec
    for name, (kind, ok) in _FIELD_TYPES.items():
        if name in raw and not ok(raw[name]):
            rec.error = f"{where}: {name!r} must be {kind}, got {json.dumps(raw[name])}"
            return rec
    rec.prompt = prompt_from_record(raw, where)
    overrides = {k: v for k, v in raw.items() if k in SAMPLING_FIELDS}
    rec.params = SamplingParams(**{**defaults.__dict__, **overrides})
    return rec


def read_records(path: str, defaults: SamplingParams) -> list[BatchRecord]:
    """Every non-blank line of ``path`` as a record (a bad line becomes an error record).

    Raises ConfigError if two records share an id: their outputs could not be told apart.
    """
    out: list[BatchRecord] = []
    first_line: dict[str, int] = {}
    with open(path, "rb") as f:  # each line decoded alone: one bad line spoils only itself
        for n, data in enumerate(f, 1):
            where = f"{os.path.basename(path)}:{n}"
            try:
                line = decode_line(data, where)
            except ConfigError as e:
                out.append(BatchRecord(None, n, error=str(e)))
                continue
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except ValueError as e:
                out.append(BatchRecord(None, n, error=f"{where}: malformed JSON "
                                                      f"({getattr(e, 'msg', e)})"))
                continue
            try:
                rec = _parse(raw, where, n, defaults)
            except SSDError as e:
                rid = raw.get("id") if isinstance(raw, dict) else None
                rec = BatchRecord(rid if isinstance(rid, str) or _is_int(rid) else None, n,
                                  error=str(e) if str(e).startswith(where) else f"{where}: {e}")
            if rec.id is not None:
                seen = first_line.setdefault(json.dumps(rec.id), n)
                if seen != n:
                    raise ConfigError(f"{where}: id {json.dumps(rec.id)} is already used on "
                                      f"line {seen}; ids must be unique")
            out.append(rec)
    return out


def load_done(path: str) -> list[dict]:
    """Records already written by an earlier run (a torn last line, or any line that is not a
    JSON object in UTF-8, is ignored: its record is generated again)."""
    if not os.path.exists(path):
        return []
    done = []
    with open(path, "rb") as f:
        for line in f:
            try:
                rec = json.loads(line.decode("utf-8"))
            except ValueError:  # UnicodeDecodeError included
                continue
            if isinstance(rec, dict):
                done.append(rec)
    return done


def run_batch(gen, records: list[BatchRecord], output: str, chat: bool, chunk: int,
              progress=None) -> dict:
    """Generate every record not already finished in ``output``; returns summary metrics."""
    keys = {r.key for r in records}
    results: dict[tuple, dict] = {}  # by record key: finished outputs
    foreign = []  # finished records of no current input record: kept, after the others
    for rec in load_done(output):
        if "error" in rec:  # retried (or gone, if its input line changed)
            continue
        key = output_key(rec)
        if key in keys:
            results.setdefault(key, rec)
        else:
            foreign.append(rec)
    todo = [r for r in records if r.key not in results]
    summary = {"records": len(records), "skipped_done": len(records) - len(todo), "errors": 0,
               "tokens": 0, "wall_s": 0.0}
    if progress is not None:
        progress.update(summary["skipped_done"])
    for r in todo:
        if r.error is None:
            try:
                gen.validate([r.prompt], [r.params], chat)  # prompt, ids, length
            except SSDError as e:
                r.error = f"line {r.line}: {e}"
    valid = [r for r in todo if r.error is None]
    if valid:
        # the whole file's work decides compile="auto" and shapes the warm-up (its first
        # max_batch prompts), before the first chunk is timed
        gen.start([r.prompt for r in valid], [r.params for r in valid], chat)
        if gen.ready_s is not None:
            summary["ready_s"] = gen.ready_s
    for start in range(0, len(todo), chunk):
        part = todo[start:start + chunk]
        good = []
        for r in part:
            if r.error is None:
                good.append(r)
                continue
            results[r.key] = r.result(error=r.error)
            summary["errors"] += 1
        if good:
            outs = gen.generate([r.prompt for r in good], [r.params for r in good], chat=chat)
            m = gen.last_run_metrics
            summary["tokens"] += m["tokens"]
            summary["wall_s"] += m["wall_s"]
            for r, o in zip(good, outs):
                results[r.key] = r.result(text=o.text, token_ids=o.token_ids,
                                          finish_reason=o.finish_reason, metrics=o.metrics)
        write_jsonl_atomic(output, [results[r.key] for r in records if r.key in results]
                           + foreign)
        if progress is not None:
            progress.update(len(part))
            if summary["wall_s"]:
                progress.set_postfix(tok_s=f"{summary['tokens'] / summary['wall_s']:.1f}")
    summary["tok_s"] = summary["tokens"] / summary["wall_s"] if summary["wall_s"] else 0.0
    return summary
