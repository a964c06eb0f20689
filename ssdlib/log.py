"""Rank-aware logging. The library never prints; it logs through ``get_logger``."""

import logging
import os

_FORMAT = "%(asctime)s [ssdlib rank %(rank)s] %(levelname)s %(message)s"
# start-up progress: one INFO line a phase (load, capture and compile), shown at the CLIs' default
# level too (WARNING), as 20-40 s of silent start-up look like a hang
PROGRESS = "ssdlib.progress"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


def get_logger(name: str = "ssdlib") -> logging.Logger:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    return logger


def progress_logger() -> logging.Logger:
    """The logger of start-up progress (see PROGRESS): :func:`setup_logging` shows its INFO
    lines unless the level is ERROR or above."""
    return get_logger(PROGRESS)


def setup_logging(level: str = "WARNING", all_ranks: bool = False) -> None:
    """Configure the ``ssdlib`` logger; by default only rank 0 speaks above WARNING."""
    logger = logging.getLogger("ssdlib")
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and not all_ranks:
        level = "ERROR"
    logger.setLevel(level)
    logging.getLogger(PROGRESS).setLevel(
        min(logger.level, logging.INFO) if logger.level <= logging.WARNING else logger.level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
    logger.propagate = False
