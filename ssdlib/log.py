"""Rank-aware logging. The library never prints; it logs through ``get_logger``."""

import logging
import os

_FORMAT = "%(asctime)s [ssdlib rank %(rank)s] %(levelname)s %(message)s"


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


def get_logger(name: str = "ssdlib") -> logging.Logger:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _RankFilter) for f in logger.filters):
        logger.addFilter(_RankFilter())
    return logger


def setup_logging(level: str = "WARNING", all_ranks: bool = False) -> None:
    """Configure the ``ssdlib`` logger; by default only rank 0 speaks above WARNING."""
    logger = logging.getLogger("ssdlib")
    rank = int(os.environ.get("RANK", "0"))
    if rank != 0 and not all_ranks:
        level = "ERROR"
    logger.setLevel(level)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler.addFilter(_RankFilter())
        logger.addHandler(handler)
    logger.propagate = False
