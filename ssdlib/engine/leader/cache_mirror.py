"""The leader's copy of the speculation cache's keys and tokens, and its lookup.

The speculator pushes each build's rows (a CACHE message, ``protocol.CacheRows``); the leader
keeps them by KV slot and answers an outcome (k, t*) itself: a hit is the next speculation at
once, with no exchange on the round's critical path. A miss takes the fallback the CACHE named:
n-gram or random tokens drawn here (``local_fallback``), or the speculator's jit draft.
"""

from __future__ import annotations

from dataclasses import dataclass

from ssdlib.distributed.protocol import CacheRows
from ssdlib.speculative.fallback import FALLBACKS
from ssdlib.speculative.ngram import NGRAM_Q, RANDOM_Q, propose_ngram, random_tokens_host
from ssdlib.speculative.rng import RowStream

# Salt of the leader's per-row streams for local fallback draws (apart from the sequence's own
# stream and the speculator's, ``spec_row.SPEC_STREAM``).
FALLBACK_STREAM = 5_555_555


@dataclass
class MirrorRow:
    fallback: str  # "jit" | "ngram" | "random": for a miss
    keys: dict[tuple[int, int], int]  # (k, t*) -> the first branch assuming it
    tokens: list[list[int]]  # [B][K]


class CacheMirror:
    """Rows by KV slot, refreshed by each CACHE; a row not (yet) pushed misses, with jit."""

    def __init__(self):
        self.rows: dict[int, MirrorRow] = {}

    def update(self, slots: list[int], msg: CacheRows) -> None:
        """The CACHE for the OUTCOME of rows ``slots`` (same order) arrived."""
        for i, slot in enumerate(slots):
            if not msg.ready[i]:
                self.rows.pop(slot, None)
                continue
            keys: dict[tuple[int, int], int] = {}
            for j, key in enumerate(zip(msg.fork[i], msg.bonus[i])):
                keys.setdefault(key, j)  # the first matching branch answers
            self.rows[slot] = MirrorRow(FALLBACKS[msg.fallback[i]], keys, msg.tokens[i])

    def forget(self, slot: int) -> None:
        self.rows.pop(slot, None)

    def lookup(self, slot: int, k: int, bonus: int) -> tuple[int | None, list[int] | None, str]:
        """-> (branch, its tokens, the fallback for a miss): branch and tokens None on a miss."""
        row = self.rows.get(slot)
        if row is None:
            return None, None, "jit"
        j = row.keys.get((k, bonus))
        if j is None:
            return None, None, row.fallback
        return j, row.tokens[j], row.fallback


def local_fallback(kind: str, tokens: list[int], stream: RowStream, k: int,
                   vocab_size: int) -> tuple[list[int], int]:
    """A miss's speculation drawn on the leader: n-gram (random where no suffix recurs) or random
    -> (tokens [K], QKind). K draws of ``stream`` are taken either way."""
    drawn = random_tokens_host([stream], k, vocab_size)[0]
    if kind == "ngram":  # ngram_or_random's rule for one row, without its tensors
        proposal = propose_ngram(tokens, k)
        if proposal is not None:
            return proposal, int(NGRAM_Q)
        return drawn, int(RANDOM_Q)
    if kind == "random":
        return drawn, int(RANDOM_Q)
    raise ValueError(f"no local fallback {kind!r} (jit is the speculator's)")
