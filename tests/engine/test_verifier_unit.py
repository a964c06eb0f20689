"""SSDVerifier.step with fake target and link: a greedy row whose speculation arrived without q
(an exchange with no sampling rows) is verified correctly next to a sampled row."""

import torch

from ssdlib.engine.protocol import Speculation
from ssdlib.engine.sequence import Request, Sequence
from ssdlib.engine.verifier import SSDVerifier
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
        self.sent = []

    def send_outcome(self, out, sampling):
        self.sent.append(out.clone())

    def recv_spec(self, b, sampling):
        return Speculation(torch.full((b, K), 2), torch.zeros(b, dtype=torch.int64),
                           torch.ones(b, dtype=torch.bool),
                           torch.full((b, K, V), 1.0 / V) if sampling else None)


def test_greedy_row_without_q_next_to_sampled_row():
    link = FakeLink()
    ver = SSDVerifier(FakeTarget(), link, K, torch.device("cpu"))
    g = Sequence(Request(0, [1, 1], SamplingParams(max_new_tokens=50)), 0, [], None, "cpu")
    s = Sequence(Request(1, [1, 1], SamplingParams(max_new_tokens=50, temperature=1.0, seed=0)),
                 1, [], None, "cpu")
    for q in (g, s):
        q.commit([2])
    ver.spec[0] = (torch.full((K,), 2), int(QKind.DENSE), None)  # from a greedy-only exchange
    ver.spec[1] = (torch.full((K,), 2), int(QKind.DENSE), torch.full((K, V), 1.0 / V))
    ver.step([g, s])
    assert g.tokens[-(K + 1):] == [2] * (K + 1)  # all K accepted + bonus, as greedy AR would
    k_sent = link.sent[-1][:, 1].tolist()
    assert k_sent[0] == K
