"""Mode ``ssd`` on the leader: :class:`SSDVerifier`, the role of :class:`LinkVerifier` whose next
speculation comes from the leader's copy of the speculation cache (``cache_mirror.py``): a hit
at once; a miss from the backup the speculator named (Thm 17): n-gram or random tokens drawn
here from a per-row stream of the leader's own, or the speculator's jit draft."""

from __future__ import annotations

import torch

from ssdlib.engine.cache_mirror import FALLBACK_STREAM, CacheMirror, local_fallback
from ssdlib.engine.metrics import record_lookup
from ssdlib.engine.protocol import Choice
from ssdlib.engine.local_link import LocalLink
from ssdlib.engine.spec_link import SpecLink
from ssdlib.engine.speculator import build_speculator
from ssdlib.engine.verifier import LinkVerifier, link_for
from ssdlib.speculative.fanout import cache_branches
from ssdlib.speculative.rng import RowStream


class SSDVerifier(LinkVerifier):
    """Mode ``ssd``: each speculation comes from the speculation cache (hit) or a fallback.

    After each OUTCOME the speculator builds the cache for it and pushes the built rows (CACHE)
    while this side verifies; the receive is posted once the verify forward is launched and
    completed after the round's read-back. Misses are drawn here (n-gram / random, from a
    per-row stream) or asked of the speculator (jit), as the CACHE says."""

    def __init__(self, target, link: SpecLink | LocalLink, k: int, device):
        super().__init__(target, link, k, device)
        self.mirror = CacheMirror()  # the leader's copy of the speculation cache
        # the rows (slots, in order) of the last OUTCOME whose CACHE is still to be received
        self._cache_due: list[int] | None = None
        self._cache_posted = False  # its receive is posted (``SpecLink.post_cache``)
        self._streams: dict[int, RowStream] = {}  # per slot: the local fallbacks' draws

    def _admit_row(self, q) -> None:
        self.mirror.forget(q.slot)
        self._streams[q.slot] = RowStream.from_seed(
            q.params.seed, FALLBACK_STREAM + q.request.stream_salt)

    def _record_lookup(self, q, k: int, hit: bool, kind: int) -> None:
        record_lookup(q.metrics, k, hit, kind)

    def _choose(self, q, k: int, bonus: int) -> tuple[int, int, list[int]]:
        branch, tokens, fallback = self.mirror.lookup(q.slot, k, bonus)
        if branch is not None:
            return int(Choice.CACHE), branch, tokens
        if fallback == "jit":
            return self._ask_jit()
        tokens, kind = local_fallback(fallback, q.tokens, self._streams[q.slot], self.k,
                                      self.link.vocab_size)
        return int(Choice.LOCAL), kind, tokens

    def _expect_cache(self, slots: list[int]) -> None:
        self._cache_due = slots

    def _after_launch(self) -> None:
        super()._after_launch()  # the link's order: a due q, then the CACHE
        if self._cache_due is not None and not self._cache_posted:
            self.link.post_cache(len(self._cache_due))
            self._cache_posted = True

    def _take_cache(self) -> bool:
        """Receive the CACHE the speculator pushes after building for the last OUTCOME (waits
        for the build's end if it outlasted the verify); a due q comes before it. Returns
        whether one was due."""
        super()._take_cache()  # a due q
        if self._cache_due is None:
            return False
        slots, self._cache_due = self._cache_due, None
        self._cache_posted = False
        self.mirror.update(slots, self.link.recv_cache(len(slots)))
        return True

    def release(self, seq) -> None:
        self._streams.pop(seq.slot, None)
        super().release(seq)

    def batch_metrics(self) -> dict:
        out = super().batch_metrics()
        overlap = getattr(self.link, "overlap", None)  # the stream placement, on a GPU
        if overlap is not None and overlap.rounds:
            out["stream_overlap"] = overlap.take()
        return out


def build_ssd_verifier(cfg, world, target, target_ck):
    """The leader's SSD loop and its link to the speculator: a rank of its own (``rank``
    placement), or built here, in this process, on a stream of its own (``stream``)."""
    branches = cache_branches(cfg.fan_out, cfg.fan_out_budget, cfg.k)
    if cfg.placement == "rank":
        link = link_for(cfg, world, target_ck, branches)
    else:
        link = LocalLink(world.device, cfg.max_batch, cfg.k, target_ck.config.vocab_size,
                         branches)
        with link.on_stream():
            link.attach(build_speculator(cfg, world.device, target_ck, link))
        if link.cuda:  # what was set up on other streams is done before either side runs
            torch.cuda.synchronize(world.device)
    loop = SSDVerifier(target, link, cfg.k, world.device)
    return loop, loop.close
