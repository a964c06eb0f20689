"""JSONL prompt files, and output files: checked writable up front, written atomically (a crash
never leaves a half-written file) with the permissions an ordinary file would get."""

from __future__ import annotations

import json
import os
import tempfile

from ssdlib.errors import ConfigError, SSDError


def parse_prompt_record(line: str, where: str):
    """One JSONL line -> a prompt (str, {"messages": ...} or {"prompt_ids": ...})."""
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise ConfigError(f"{where}: malformed JSON ({getattr(e, 'msg', e)})") from None
    return prompt_from_record(rec, where)


def prompt_from_record(rec: object, where: str):
    """A decoded record -> a prompt; exactly one of "prompt", "messages", "prompt_ids"."""
    if isinstance(rec, str):
        return rec
    if not isinstance(rec, dict):
        raise ConfigError(f"{where}: a record must be a JSON object or string")
    given = [k for k in ("prompt", "messages", "prompt_ids") if k in rec]
    if len(given) != 1:
        raise ConfigError(f"{where}: a record needs exactly one of 'prompt' (string), "
                          "'messages' (list) or 'prompt_ids' (list of ints)"
                          + (f", not {' and '.join(given)}" if given else ""))
    key, value = given[0], rec[given[0]]
    if key == "prompt" and isinstance(value, str):
        return value
    if key == "messages" and isinstance(value, list):
        return {"messages": value}
    if key == "prompt_ids" and isinstance(value, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value):
        return {"prompt_ids": value}
    kind = {"prompt": "a string", "messages": "a list of messages",
            "prompt_ids": "a list of integer token ids"}[key]
    raise ConfigError(f"{where}: '{key}' must be {kind}")


def decode_line(data: bytes, where: str) -> str:
    """One line of an input file as text; a ConfigError naming the first byte that is not
    UTF-8 (each line decoded alone, so that a bad line names itself and spoils nothing else)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not valid UTF-8 (byte 0x{data[e.start]:02x} at byte "
                          f"{e.start})") from None


def read_prompts_file(path: str) -> list:
    if not os.path.exists(path):
        raise ConfigError(f"--prompts-file {path}: no such file")
    prompts = []
    with open(path, "rb") as f:
        for n, data in enumerate(f, 1):
            line = decode_line(data, f"{path}:{n}")
            if not line.strip():
                continue
            if path.endswith(".jsonl"):
                prompts.append(parse_prompt_record(line, f"{path}:{n}"))
            else:
                prompts.append(line.rstrip("\n").replace("\\n", "\n"))
    return prompts


def check_writable(path: str, flag: str) -> None:
    """Raise ConfigError now if ``path`` cannot be written later (after the generation work)."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path}: is a directory")
    if not os.path.isdir(directory):
        raise ConfigError(f"{flag} {path}: directory {directory} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path}: directory {directory} is not writable")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ConfigError(f"{flag} {path}: file is not writable")
    # Permission bits do not tell (root passes os.access; /proc or a read-only mount refuse
    # writes anyway): open an existing file for append (which writes nothing) and create a
    # temporary file beside it, as the atomic writes do.
    try:
        if os.path.exists(path):
            with open(path, "a", encoding="utf-8"):
                pass
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot be written ({e.strerror or e})") from None


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # no thread-safe way to read it elsewhere: set and restore at once
    os.umask(mask)
    return mask


def _file_mode(path: str) -> int:
    """An existing file keeps its mode; a new one gets what open() would give (0666 & ~umask)."""
    try:
        return os.stat(path).st_mode & 0o7777
    except OSError:
        return 0o666 & ~_umask()


def write_jsonl_atomic(path: str, records: list[dict]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".jsonl")
    except OSError as e:
        raise SSDError(f"cannot write {path}: {e.strerror or e}") from None
    try:
        os.fchmod(fd, _file_mode(path))  # mkstemp makes it 0600 whatever the umask
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for r in records:
                f.write(json.dumps(r, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str, obj: object) -> None:
    """Write one JSON document (metrics, summaries)."""
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
    except OSError as e:
        raise SSDError(f"cannot write {path}: {e.strerror or e}") from None
