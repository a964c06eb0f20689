"""Where the leader takes a row's next speculation from after each verify (the ``source`` of a
:class:`~ssdlib.engine.leader.verifier.LinkVerifier`):

- :class:`JitSource` (mode ``sd`` with ``--draft-placement separate``): every speculation is the
  speculator's draft, drafted just in time after the outcome (plain SD over a link);
- :class:`CacheSource` (mode ``ssd``): the leader's copy of the speculation cache
  (``cache_mirror.py``): a hit at once; a miss from the backup the speculator named (Thm 17):
  n-gram or random tokens drawn here from a per-row stream of the leader's own, or the
  speculator's jit draft.

Both answer the same questions; only the cache source receives CACHEs (``pushes_cache``).
"""

from __future__ import annotations

from ssdlib.distributed.protocol import CacheRows, Choice
from ssdlib.engine.leader.cache_mirror import FALLBACK_STREAM, CacheMirror, local_fallback
from ssdlib.engine.leader.metrics import record_lookup
from ssdlib.speculative.rng import RowStream

# a row's next speculation as the OUTCOME carries it: (Choice, arg, tokens [K])
Chosen = tuple[int, int, list[int]]


def ask_jit(k: int) -> Chosen:
    """The choice that asks the speculator for a jit draft."""
    return int(Choice.JIT), 0, [0] * k


class JitSource:
    """No cache: the speculator drafts every speculation after its outcome."""

    pushes_cache = False

    def __init__(self, k: int, vocab_size: int):
        self.k = k

    def admit_row(self, q) -> None:
        """Row ``q`` joins (its slot may have been another row's)."""

    def release_row(self, slot: int) -> None:
        """The row in ``slot`` left."""

    def choose(self, q, k: int, bonus: int) -> Chosen:
        """Row ``q``'s next speculation after outcome (k accepted, bonus t*)."""
        return ask_jit(self.k)

    def record_lookup(self, q, k: int, hit: bool, kind: int) -> None:
        """A speculation answering outcome k arrived (not a sequence's first)."""

    def take_cache(self, slots: list[int], cache: CacheRows) -> None:
        raise RuntimeError("a jit source receives no CACHE")


class CacheSource(JitSource):
    """SSD: the next speculation from the leader's copy of the speculation cache, or the backup
    the speculator named for a miss."""

    pushes_cache = True

    def __init__(self, k: int, vocab_size: int):
        super().__init__(k, vocab_size)
        self.vocab_size = vocab_size
        self.mirror = CacheMirror()
        self.streams: dict[int, RowStream] = {}  # per slot: the local fallbacks' draws

    def admit_row(self, q) -> None:
        self.mirror.forget(q.slot)
        self.streams[q.slot] = RowStream.from_seed(
            q.params.seed, FALLBACK_STREAM + q.request.stream_salt)

    def release_row(self, slot: int) -> None:
        self.streams.pop(slot, None)

    def choose(self, q, k: int, bonus: int) -> Chosen:
        branch, tokens, fallback = self.mirror.lookup(q.slot, k, bonus)
        if branch is not None:
            return int(Choice.CACHE), branch, tokens
        if fallback == "jit":
            return ask_jit(self.k)
        tokens, kind = local_fallback(fallback, q.tokens, self.streams[q.slot], self.k,
                                      self.vocab_size)
        return int(Choice.LOCAL), kind, tokens

    def record_lookup(self, q, k: int, hit: bool, kind: int) -> None:
        record_lookup(q.metrics, k, hit, kind)

    def take_cache(self, slots: list[int], cache: CacheRows) -> None:
        self.mirror.update(slots, cache)
