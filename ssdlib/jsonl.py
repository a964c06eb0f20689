"""JSONL prompt files and atomic JSONL output (a crash never leaves a half-written file)."""

from __future__ import annotations

import json
import os
import tempfile

from ssdlib.errors import ConfigError


def parse_prompt_record(line: str, where: str):
    """One JSONL line -> a prompt (str, {"messages": ...} or {"prompt_ids": ...})."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"{where}: malformed JSON ({e.msg})") from None
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: a record must be a JSON object or string")
    if "prompt" in rec and isinstance(rec["prompt"], str):
        return rec["prompt"]
    if "messages" in rec and isinstance(rec["messages"], list):
        return {"messages": rec["messages"]}
    if "prompt_ids" in rec and isinstance(rec["prompt_ids"], list):
        return {"prompt_ids": rec["prompt_ids"]}
    raise ConfigError(f"{where}: a record needs 'prompt' (string), 'messages' (list) or "
                      "'prompt_ids' (list of ints)")


def read_prompts_file(path: str) -> list:
    if not os.path.exists(path):
        raise ConfigError(f"--prompts-file {path}: no such file")
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                prompts.append(parse_prompt_record(line, f"{path}:{n}"))
            else:
                prompts.append(line.rstrip("\n").replace("\\n", "\n"))
    return prompts


def write_jsonl_atomic(path: str, records: list[dict]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".jsonl")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
