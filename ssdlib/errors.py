"""User-facing errors.

Anything a user can fix (a bad path, a bad flag, a malformed record) raises a subclass of
:class:`SSDError`; the CLI prints its message as one line and exits non-zero. Internal bugs stay
ordinary exceptions so they keep their traceback.
"""


class SSDError(Exception):
    """An error caused by user input; its message names the problem and what to do."""


class CheckpointError(SSDError):
    """A checkpoint is missing, corrupt, unsupported or inconsistent with its config."""


class ConfigError(SSDError, ValueError):
    """Invalid configuration (flags, sampling parameters, world size)."""


class RankFailure(SSDError):
    """Another rank of the job failed; the message carries that rank's error."""
