"""Every environment variable ssdlib reads, in one table, and the typed accessors that read them.

A module asks for its switch by name (``env.flag("SSDLIB_HOST_TIMES")``); the value is read from
``os.environ`` at that call, never at import, so tests and launchers can set a variable late and
spawned ranks see what their parent set. Unset or empty means the table's default. A value that
does not parse raises :class:`~ssdlib.errors.ConfigError` naming the variable.

Kinds (how a value parses):

- ``flag``: ``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off`` (any case), as setup.py
  reads its own flags;
- ``int``: an integer >= the entry's ``minimum``;
- ``choice``: one of the entry's ``choices`` (any case);
- ``text``: any string (a directory, a key);
- ``paths``: directories separated by ``os.pathsep``;
- ``window``: ``W:N``, two integers, W >= 0 and N >= 1.

Entries whose ``reader`` is not ``"ssdlib"`` are read elsewhere and listed here so the table is
complete: setup.py reads the build switches itself (it runs before the package exists, so it
cannot import this module), and ``tools/bench.py`` reads ``SSDLIB_COMMIT``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ssdlib.errors import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


@dataclass(frozen=True)
class Switch:
    """One environment variable: its name, how it parses, its value when unset, what it does."""

    name: str
    kind: str  # flag, int, choice, text, paths or window (see the module doc)
    default: object
    meaning: str
    choices: tuple[str, ...] = ()
    minimum: int = 0
    reader: str = "ssdlib"  # who reads it: the package, "setup.py" or a tool's path
    experiment: bool = False  # an unmeasured idea behind a switch, off by default


SWITCHES: tuple[Switch, ...] = (
    # engine
    Switch("SSDLIB_MODEL_DIRS", "paths", [],
           "directories searched first for named checkpoints (ssdlib.loading.registry)"),
    Switch("SSDLIB_CACHE_DIR", "text", None,
           "where compiled kernels persist; unset: $XDG_CACHE_HOME/ssdlib or ~/.cache/ssdlib "
           "(ssdlib.engine.runner.compile_cache; the --cache-dir flag wins)"),
    Switch("SSDLIB_BYTECODE_CACHE", "flag", True,
           "0: never keep Python bytecode in the cache directory (ssdlib.bytecode_cache: only "
           "where torch's install has none and none would be written beside it)"),
    Switch("SSDLIB_STEP_GRAPHS", "choice", "",
           "'eager' / 'eager-all': CPU runners take the GPU's captured-step code path, run "
           "eagerly (for tests; ssdlib.engine.runner.model_runner)",
           choices=("eager", "eager-all")),
    Switch("SSDLIB_PREFILL_GRAPHS", "flag", True,
           "0: prefill runs eagerly instead of through captured length buckets on CUDA"),
    Switch("SSDLIB_CAUSAL_PREFILL", "flag", True,
           "0: a prompt's prefill from position 0 attends through the masked path (SDPA with a "
           "dense mask over the cache) instead of causally over its own keys "
           "(ssdlib.layers.attention)"),
    Switch("SSDLIB_ATTENTION", "choice", "",
           "'torch': CUDA steps use the PyTorch attention instead of the Triton slot kernel",
           choices=("torch",)),
    Switch("SSDLIB_ROW_TOP", "choice", "",
           "'torch': CUDA steps take argmaxes and top-k candidates with torch's kernels instead "
           "of the Triton ones (ssdlib/ops/row_top.py)", choices=("torch",)),
    Switch("SSDLIB_DISABLE_EXT", "flag", False,
           "1: never use the compiled extension ssdlib._C (pure-PyTorch ops, torch's CUDA graphs)"),
    Switch("SSDLIB_K_SCHEDULE", "text", None,
           "comma-separated K values (0 .. --k): instead of the adaptive choice, the n-th "
           "choice gives the row in slot s the value at (s + n) mod their count, so rows of "
           "one round differ (for tests of the per-row limits; ssdlib.speculative.adaptive_k)"),
    Switch("SSDLIB_COMPILE_DYNAMIC", "flag", True,
           "0: compile every batch bucket of a step static, its own compile (default: the "
           "batch dimension is dynamic, one compile serves every bucket above 1; "
           "ssdlib.engine.runner.compiled)"),
    Switch("SSDLIB_QUICK_EXIT", "flag", True,
           "0: a one-shot command (ssdlib.generate, the batch tool) exits through the "
           "interpreter's full teardown instead of ending at once (ssdlib.quick_exit)"),
    Switch("SSDLIB_Q_AFTER_BUILD", "flag", False,
           "1: the speculator sends a sampling SPEC's q after launching the cache build instead "
           "of before it (ssdlib.engine.speculator.outcomes)", experiment=True),
    Switch("SSDLIB_CHAINED_ROUNDS", "flag", True,
           "SSD's stream placement runs small batches in chained rounds: the next verify and build "
           "launched before the host reads the round in flight, the cache looked up on the "
           "device (ssdlib.engine.leader.chained_rounds); 0: every round through the host"),
    Switch("SSDLIB_CHAIN_MAX_ROWS", "int", 8,
           "chained rounds run for batches of at most this many rows; larger batches take "
           "every round through the host (ssdlib.distributed.protocol.chain_max_rows)",
           minimum=1),
    Switch("SSDLIB_CHAIN_SAMPLED", "flag", True,
           "chained rounds take sampling rows too (temperature > 0: the exact acceptance, the "
           "cache's q and the rows' random streams on the device); 0: greedy rows only "
           "(ssdlib.engine.leader.chained_rounds)"),
    Switch("SSDLIB_CHAIN_NGRAM", "flag", True,
           "a chained round's miss verifies the device n-gram proposal (0: placeholder zeros; "
           "ssdlib.engine.speculator.spec_cache.next_speculation)"),
    Switch("SSDLIB_CHAIN_ESTIMATES", "flag", True,
           "each chained round read back feeds the speculator's fan-out and fallback estimates "
           "(0: they keep the values the chain started with; ssdlib.engine.leader.verifier)"),
    Switch("SSDLIB_CHAIN_COMPILE", "flag", True,
           "chained rounds' next speculation (device lookup and n-gram, ~50 small kernels a "
           "side) and a round's acceptance and records (~30) through torch.compile where the "
           "steps compile; 0: eager (ssdlib.engine.speculator.spec_cache.next_speculation, "
           "ssdlib.engine.leader.chained_rounds.maybe_compiled)"),
    Switch("SSDLIB_BUDGET_THROUGHPUT", "flag", True,
           "the fan-out budget tuner holds the chained build's budget of the most expected "
           "tokens a millisecond of round; 0: the largest whose build the verify hides "
           "(ssdlib.speculative.fanout_budget)"),
    Switch("SSDLIB_FANOUT_KINDS", "flag", True,
           "the fan-out's miss model keeps the lookups after the draft's own rejected token apart "
           "from the rest (one slope, an intercept each: the allocation and the backups' "
           "predicted hit rates); 0: every lookup pooled (ssdlib.speculative.fanout)"),
    Switch("SSDLIB_FEATURE_COMPILE", "flag", False,
           "a feature draft's decoder layers compiled in its captured steps (SD's proposals, "
           "SSD's commits, jit drafts and builds) where a draft runner's would compile; off: "
           "the plain layers (ssdlib.engine.runner.compiled.feature_compile_backend)"),
    Switch("SSDLIB_STREAM_PRIORITY", "choice", "verifier",
           "which side of the stream placement gets the GPU first when both have work queued: "
           "'verifier' (the verify's stream the highest priority, the build's the lowest), "
           "'speculator' (the reverse) or 'equal' (ssdlib.distributed.local_link)",
           choices=("verifier", "speculator", "equal")),
    # measurement
    Switch("SSDLIB_TIME_EVERY", "int", 1,
           "the round timers time one round in N (ssdlib.engine.timing)", minimum=1),
    Switch("SSDLIB_HOST_TIMES", "flag", False,
           "1: host-clock segments of each round on both sides of the link (HostClock)"),
    Switch("SSDLIB_PROFILE", "text", None,
           "a directory: write torch.profiler traces there (ssdlib.profiling)"),
    Switch("SSDLIB_PROFILE_CALL", "int", 1,
           "which generate call after the engine's warm-up the leader profiles (1 = the "
           "first; tools/bench.py: 2, its first timed pass)", minimum=1),
    Switch("SSDLIB_PROFILE_ROUNDS", "window", (200, 100),
           "W:N: the speculator profiles its OUTCOME rounds W .. W+N-1"),
    Switch("SSDLIB_PROFILE_PY", "flag", False, "1: add a cProfile dump to each profile"),
    # server
    Switch("SSDLIB_API_KEY", "text", None,
           "the server requires 'Authorization: Bearer KEY' (--api-key wins)"),
    # build (setup.py reads these itself)
    Switch("SSDLIB_SKIP_EXT", "flag", False, "1: do not build the extension", reader="setup.py"),
    Switch("SSDLIB_CUDA_ARCHS", "text", "9.0",
           "CUDA architectures to build for, ';' or ',' separated", reader="setup.py"),
    Switch("SSDLIB_BUILD_CPU_EXT", "flag", False,
           "1: without CUDA, build the extension's C++ CPU kernels", reader="setup.py"),
    # tools
    Switch("SSDLIB_COMMIT", "text", None,
           "the commit a benchmark's JSON names when the source is not a git checkout",
           reader="tools/bench.py"),
)
_BY_NAME = {s.name: s for s in SWITCHES}


def switch(name: str) -> Switch:
    """The table's entry for ``name``; KeyError for a variable the table does not list."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not an ssdlib environment variable (see ssdlib.env)") from None


def _bad(s: Switch, want: str, raw: str) -> ConfigError:
    return ConfigError(f"{s.name} must be {want}, got {raw!r}")


def _int(s: Switch, part: str, minimum: int, want: str, raw: str) -> int:
    """``part`` (of the value ``raw``) as an integer >= ``minimum``."""
    try:
        value = int(part)
    except ValueError:
        raise _bad(s, want, raw) from None
    if value < minimum:
        raise _bad(s, want, raw)
    return value


def _parse(s: Switch, raw: str):
    if s.kind == "flag":
        low = raw.lower()
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise _bad(s, "0 or 1 (or true/false, yes/no, on/off)", raw)
    if s.kind == "int":
        return _int(s, raw, s.minimum, f"an integer >= {s.minimum}", raw)
    if s.kind == "choice":
        if raw.lower() in s.choices:
            return raw.lower()
        raise _bad(s, " or ".join(repr(c) for c in s.choices) + " (or unset)", raw)
    if s.kind == "paths":
        return [d for d in raw.split(os.pathsep) if d]
    if s.kind == "window":
        want = "W:N with integers W >= 0 and N >= 1"
        first, colon, count = raw.partition(":")
        if not colon:
            raise _bad(s, want, raw)
        return _int(s, first, 0, want, raw), _int(s, count, 1, want, raw)
    return raw  # text


def get(name: str):
    """The value of ``name`` now, parsed by its kind; the table's default when unset or empty."""
    s = switch(name)
    raw = os.environ.get(name, "").strip()
    if not raw:
        return list(s.default) if isinstance(s.default, list) else s.default
    return _parse(s, raw)


def _typed(name: str, kind: str):
    if switch(name).kind != kind:
        raise TypeError(f"{name} is a {switch(name).kind}, not a {kind}")
    return get(name)


def flag(name: str) -> bool:
    """A ``flag`` switch's value now."""
    return _typed(name, "flag")


def integer(name: str) -> int:
    """An ``int`` switch's value now."""
    return _typed(name, "int")


def choice(name: str) -> str:
    """A ``choice`` switch's value now ("" when unset)."""
    return _typed(name, "choice")


def text(name: str) -> str | None:
    """A ``text`` switch's value now (None when unset or empty)."""
    return _typed(name, "text")


def paths(name: str) -> list[str]:
    """A ``paths`` switch's directories now (empty entries dropped)."""
    return _typed(name, "paths")


def window(name: str) -> tuple[int, int]:
    """A ``window`` switch's (W, N) now."""
    return _typed(name, "window")
