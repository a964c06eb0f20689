"""User-facing errors, and the exit code of each kind.

Anything a user can fix (a bad path, a bad flag, a malformed record, a model that does not fit)
raises a subclass of :class:`SSDError`; the CLIs print its message as one line. Internal bugs stay
ordinary exceptions so they keep their traceback.

Exit codes, one per kind of error, the same whether the error is found in the main process or in
a spawned rank (see :func:`exit_code`):

- ``EXIT_USER_ERROR`` (2): bad input (flags, sampling parameters, checkpoint, tokenizer, prompt,
  memory that does not fit);
- ``EXIT_FAILURE`` (1): a rank crashed or died for another reason (a bug, a killed process);
- ``EXIT_INTERRUPTED`` (130): Ctrl-C (the shell convention, 128 + SIGINT).
"""

from __future__ import annotations

EXIT_FAILURE = 1
EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130


class SSDError(Exception):
    """An error caused by user input; its message names the problem and what to do."""


class CheckpointError(SSDError):
    """A checkpoint is missing, corrupt, unsupported or inconsistent with its config."""


class ConfigError(SSDError, ValueError):
    """Invalid configuration (flags, sampling parameters, world size)."""


def require_int(name: str, value: object, low: int) -> int:
    """``value`` when it is an int (not a bool) >= ``low``; else ConfigError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be an integer >= {low}, got {value!r}")
    return value


class RankFailure(SSDError):
    """A rank of the job failed; the message carries that rank's error.

    ``rank`` is the rank that failed first (None if unknown) and ``cause`` the :class:`SSDError`
    it raised, rebuilt in this process (None when it crashed on a bug or died without a report).
    """

    def __init__(self, message: str, rank: int | None = None, cause: SSDError | None = None):
        super().__init__(message)
        self.rank = rank
        self.cause = cause


def exit_code(error: BaseException) -> int:
    """The process exit code for ``error`` (see the module docstring)."""
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(error, RankFailure):
        return EXIT_FAILURE if error.cause is None else exit_code(error.cause)
    if isinstance(error, SSDError):
        return EXIT_USER_ERROR
    return EXIT_FAILURE


def error_kind(error: BaseException) -> str | None:
    """The name of the most specific class of this module that ``error`` is (None: not an
    :class:`SSDError`), so a spawned rank can report it and the parent rebuild it."""
    for cls in type(error).__mro__:
        if cls.__module__ == __name__ and issubclass(cls, SSDError) and cls is not RankFailure:
            return cls.__name__
    return None


def rebuild_error(kind: str | None, message: str) -> SSDError | None:
    """The inverse of :func:`error_kind`: an instance of the named class with ``message``."""
    cls = {c.__name__: c for c in (SSDError, CheckpointError, ConfigError)}.get(kind or "")
    return None if cls is None else cls(message)
