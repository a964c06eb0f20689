"""A chained round's tail (acceptance and records) as the captured verify runs it, eager and
through torch.compile, against the reference: ``verify_greedy`` and ``ChainState``'s writes."""

import pytest
import torch

from ssdlib.distributed.protocol import ChainState
from ssdlib.engine.leader.chained_rounds import HEAD, greedy_tail, maybe_compiled, record_round
from ssdlib.speculative.acceptance import verify_greedy

ROWS, K, V, MAX_LEN = 5, 3, 17, 40


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(ROWS, K + 1, V, generator=g)
    best = logits.argmax(-1)
    spec = torch.randint(0, V, (ROWS, K), generator=g)
    # rows accept 0, 1, 2, 3, 3 tokens: the speculation is the argmax up to a planted miss
    for row, k in enumerate((0, 1, 2, 3, 3)):
        spec[row, :k] = best[row, :k]
        if k < K:
            spec[row, k] = (best[row, k] + 1) % V
    n = torch.tensor([4, 9, 30, 36, MAX_LEN - 2])  # the last row's commits run past the end
    hit = torch.tensor([True, False, True, False, True])
    branch = torch.tensor([2, 0, 1, 0, 5])
    ngram = torch.tensor([False, True, False, False, False])
    return logits, spec, n, hit, branch, ngram


def _state(seed):
    st = ChainState.empty(ROWS, K, MAX_LEN, "cpu")
    g = torch.Generator().manual_seed(seed + 100)
    st.history.copy_(torch.randint(0, V, st.history.shape, generator=g))
    return st, torch.zeros(2, ROWS, HEAD + K, dtype=torch.int64)


def _reference(st, pack, p, logits, spec, n, hit, branch, ngram):
    out = verify_greedy(spec, logits)
    st.k[p] = out.accepted
    st.bonus[p] = out.bonus
    st.n[p] = n
    st.spec[p] = spec
    st.commit(p, ROWS)
    pack[p] = torch.cat([out.accepted.view(-1, 1), out.bonus.view(-1, 1), hit.view(-1, 1).long(),
                         branch.view(-1, 1).long(), ngram.view(-1, 1).long(), spec], dim=1)


def _into(st, pack, p):
    return st.k[p], st.bonus[p], st.n[p], st.spec[p], st.history, pack[p]


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("p", [0, 1])
def test_the_greedy_tail_writes_what_the_reference_does(compiled, p):
    logits, spec, n, hit, branch, ngram = _inputs(p)
    ref, ref_pack = _state(p)
    _reference(ref, ref_pack, p, logits, spec, n, hit, branch, ngram)
    st, pack = _state(p)
    tail = maybe_compiled(greedy_tail, compiled)
    assert (tail is not greedy_tail) == compiled
    tail(*_into(st, pack, p), spec, logits.argmax(-1), n, hit, branch, ngram)
    assert ref.k[p].tolist() == [0, 1, 2, 3, 3]
    for name in ("k", "bonus", "n", "spec", "history"):
        assert torch.equal(getattr(st, name), getattr(ref, name)), name
    assert torch.equal(pack, ref_pack)
    assert not torch.equal(st.history, _state(p)[0].history)  # the commit wrote something


def test_record_round_takes_a_sampled_outcome_as_given():
    logits, spec, n, hit, branch, ngram = _inputs(3)
    st, pack = _state(3)
    accepted, bonus = torch.tensor([1, 0, 3, 2, 0]), torch.tensor([5, 6, 7, 8, 9])
    record_round(*_into(st, pack, 1), accepted, bonus, n, spec, hit, branch, ngram)
    assert st.k[1].tolist() == accepted.tolist() and st.bonus[1].tolist() == bonus.tolist()
    assert pack[1, :, 0].tolist() == accepted.tolist() and pack[1, :, HEAD:].equal(spec)
    assert st.history[2, 30:34].tolist() == spec[2].tolist() + [7]
    assert st.k[0].eq(0).all()  # the other parity untouched
