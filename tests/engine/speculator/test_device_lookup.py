"""The speculation cache's lookup on the device (chained rounds) against the leader's host
lookup (its mirror of the pushed CACHE), the reference: the same hit, branch and tokens for
every outcome, whatever the keys (repeated keys: the first branch answers; rows not ready
miss)."""

import torch

from ssdlib.distributed.protocol import CacheRows
from ssdlib.engine.leader.cache_mirror import CacheMirror
from ssdlib.engine.speculator.spec_cache import SpeculationCache


def test_device_lookup_matches_the_mirror():
    gen = torch.Generator().manual_seed(0)
    rows, B, K, V = 5, 7, 3, 6  # a small vocabulary: repeated keys within a row
    cache = SpeculationCache(rows, B, K, V, torch.device("cpu"))
    cache.fork.copy_(torch.randint(0, K + 1, (rows, B), generator=gen))
    cache.bonus.copy_(torch.randint(0, V, (rows, B), generator=gen))
    cache.tokens.copy_(torch.randint(0, V, (rows, B, K), generator=gen))
    cache.ready.copy_(torch.tensor([True, True, False, True, True]))
    slots = torch.arange(rows)
    mirror = CacheMirror()
    msg = cache.pushed_rows(slots, torch.ones(rows, dtype=torch.bool), 0)
    mirror.update(slots.tolist(), CacheRows.unpack(msg, B, K))
    hits = misses = 0
    for k in range(K + 1):
        for t in range(V):
            for slot_order in (slots, slots.flip(0)):
                kk = torch.full((rows,), k)
                tt = torch.full((rows,), t)
                hit, branch, tokens = cache.lookup(slot_order, kk, tt)
                for i, slot in enumerate(slot_order.tolist()):
                    want_branch, want_tokens, _ = mirror.lookup(slot, k, t)
                    assert bool(hit[i]) == (want_branch is not None), (slot, k, t)
                    if want_branch is None:
                        misses += 1
                        continue
                    hits += 1
                    assert int(branch[i]) == want_branch
                    assert tokens[i].tolist() == want_tokens
    assert hits > 0 and misses > 0
    # a key that repeats in a row: the first branch answers on both sides
    fork, bonus = cache.fork[0].tolist(), cache.bonus[0].tolist()
    keys = list(zip(fork, bonus))
    assert len(set(keys)) < len(keys), "the test needs a repeated key"


def test_a_build_of_fewer_branches_leaves_no_stale_outcome():
    """A build of a smaller budget (the tuned fan-out budget) stores b < B branches: the
    branches after them assume no outcome, so a key an earlier, larger build stored there
    misses instead of answering with that build's tokens."""
    rows, B, K, V = 3, 6, 3, 9
    cache = SpeculationCache(rows, B, K, V, torch.device("cpu"))
    slots = torch.tensor([0, 2])
    full_fork = torch.arange(B).remainder(K + 1).expand(2, B).contiguous()
    full_bonus = torch.arange(B).expand(2, B).contiguous()
    cache.store_keys(slots, full_fork, full_bonus)
    hit, branch, _ = cache.lookup(slots, torch.tensor([1, 1]), torch.tensor([5, 5]))
    assert hit.tolist() == [True, True] and branch.tolist() == [5, 5]
    cache.store_keys(slots, full_fork[:, :3], full_bonus[:, :3] + 1)  # b = 3
    assert cache.fork[slots, 3:].eq(-1).all() and cache.bonus[slots, 3:].eq(-1).all()
    hit, _, _ = cache.lookup(slots, torch.tensor([1, 1]), torch.tensor([5, 5]))
    assert hit.tolist() == [False, False]
    hit, branch, _ = cache.lookup(slots, torch.tensor([1, 1]), torch.tensor([2, 2]))
    assert hit.tolist() == [True, True] and branch.tolist() == [1, 1]
