"""The verifier side of the link with a fake target and link: a greedy row whose speculation
arrived without q (an exchange with no sampling rows) is verified correctly next to a sampled row;
only the SSD verifier records cache lookups (the separate-draft SD verifier has no cache)."""

import pytest
import torch

from ssdlib.engine.protocol import Outcome, Speculation
from ssdlib.engine.sequence import Request, Sequence
from ssdlib.engine.verifier import SeparateDraftVerifier, SpecInHand, SSDVerifier
from ssdlib.sampling import SamplingParams
from ssdlib.speculative.acceptance import QKind

K, V = 3, 7


class FakeTarget:
    """Target whose argmax is always token 2 (so a speculation of 2s is fully accepted)."""

    def forward(self, ids, positions, slots, logits_index=None):
        logits = torch.zeros(ids.shape[0], ids.shape[1], V)
        logits[..., 2] = 10.0
        return logits


class FakeLink:
    vocab_size = V

    def __init__(self):
        self.sent: list[Outcome] = []

    def send_outcome(self, msg: Outcome):
        self.sent.append(msg)

    def recv_spec(self, b, sampling):
        return Speculation(torch.full((b, K), 2), torch.zeros(b, dtype=torch.int64),
                           torch.ones(b, dtype=torch.bool),
                           torch.full((b, K, V), 1.0 / V) if sampling else None)


def _greedy_and_sampled(ver):
    g = Sequence(Request(0, [1, 1], SamplingParams(max_new_tokens=50)), 0, [], None, "cpu")
    s = Sequence(Request(1, [1, 1], SamplingParams(max_new_tokens=50, temperature=1.0, seed=0)),
                 1, [], None, "cpu")
    for q in (g, s):
        q.commit([2])
    # from a greedy-only exchange, then from a sampling one
    ver.spec[0] = SpecInHand(torch.full((K,), 2), int(QKind.DENSE), None, "cache")
    ver.spec[1] = SpecInHand(torch.full((K,), 2), int(QKind.DENSE), torch.full((K, V), 1.0 / V),
                             "jit")
    return g, s


@pytest.mark.parametrize("cls", [SSDVerifier, SeparateDraftVerifier])
def test_greedy_row_without_q_next_to_sampled_row(cls):
    link = FakeLink()
    ver = cls(FakeTarget(), link, K, torch.device("cpu"))
    g, s = _greedy_and_sampled(ver)
    ver.step([g, s])
    assert g.tokens[-(K + 1):] == [2] * (K + 1)  # all K accepted + bonus, as greedy AR would
    msg = link.sent[-1]
    assert msg.slots == [0, 1] and msg.accepted[0] == K and msg.active == [True, True]
    assert msg.sampling  # the sampled row is still running: the answer must carry q
    assert ("lookups" in g.metrics) == (cls is SSDVerifier)
    # each round's accepted tokens are kept by where its speculation came from
    assert g.metrics["accepted_by_source"] == {"cache": [1, K]}
    assert list(s.metrics["accepted_by_source"]) == ["jit"]
