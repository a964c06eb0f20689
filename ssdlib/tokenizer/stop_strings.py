"""Stop strings in streamed text: where the text ends, and how much of it may be shown yet.

Text streams out as tokens are committed, but a stop string can arrive split over several tokens
("ow" now, " ca" a token later). Text that may still turn out to be the start of a stop string is
held back until later text decides it, so a stream never shows text the final answer does not
contain. Both the server's stream and the CLIs get their text through this one rule (see
:meth:`ssdlib.engine.leader.sequence.Sequence.take_text_delta`).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """A set of stop strings (empty strings are ignored: they would stop at once)."""

    def __init__(self, stops: Sequence[str] = ()):
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.longest = max(map(len, self.stops), default=0)

    def find(self, text: str, start: int = 0) -> int | None:
        """Where the earliest stop string in ``text`` begins, or None.

        Only matches that end after ``start`` are looked for: a caller that appends to ``text``
        passes the length it had at its last search, and none of those matches existed then.
        """
        begin = max(0, start - self.longest + 1)
        found = [p for p in (text.find(s, begin) for s in self.stops) if p >= 0]
        return min(found) if found else None

    def undecided(self, text: str) -> int:
        """Length of the longest end of ``text`` that is the start of a stop string (but not a
        whole one): the characters a stream must hold back until more text arrives."""
        held = 0
        for s in self.stops:
            # the end of ``text`` equals ``s[:k]`` for some k < len(s); try the longest first
            for k in range(min(len(s) - 1, len(text)), held, -1):
                if text.endswith(s[:k]):
                    held = k
                    break
        return held

    def safe_end(self, text: str) -> int:
        """How much of ``text`` (from its start) no later text can turn into a stop string."""
        return len(text) - self.undecided(text)
