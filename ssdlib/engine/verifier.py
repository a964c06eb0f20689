"""The verifier side of SSD (leader rank): verify the speculation in hand, send the outcome,
receive the next speculation (at once on a cache hit).

Continuous batching: rows are identified by their KV slot; sequences join (ADMIT + a first
exchange) and leave (an inactive outcome) at any time.
"""

from __future__ import annotations

import time

import torch

from ssdlib.engine.ar_loop import admit_with_first_token
from ssdlib.engine.metrics import record_acceptance, record_lookup
from ssdlib.engine.protocol import SpecLink
from ssdlib.engine.timing import RoundTimer
from ssdlib.engine.verify import commit_round, read_round, verify_round
from ssdlib.loading import load_checkpoint
from ssdlib.loading.compat import check_draft_compatible
from ssdlib.speculative.acceptance import DraftQ, QKind


class SSDVerifier:
    def __init__(self, target, link: SpecLink, k: int, device, use_cache: bool = True):
        self.use_cache = use_cache  # False: plain SD with the draft on its own rank
        self.target = target
        self.link = link
        self.k = k
        self.device = device
        self.lookahead = k + 1
        self.limit: int | None = None  # set by the Leader
        # the speculation in hand per slot: (tokens [K], q kind, q [K, V] or None)
        self.spec: dict[int, tuple] = {}
        self._leaving: list[int] = []  # slots released without an inactive outcome yet
        self._batch_metrics: dict = {}
        self.timer = RoundTimer(device)

    @staticmethod
    def _admit_message(seqs):
        rows = torch.tensor([[q.slot, len(q.tokens), q.request.index,
                              -1 if q.params.seed is None else q.params.seed] for q in seqs],
                            dtype=torch.int64)
        params = torch.tensor([[q.params.temperature, q.params.top_p, float(q.params.top_k)]
                               for q in seqs], dtype=torch.float64)
        tokens = torch.tensor([t for q in seqs for t in q.tokens], dtype=torch.int64)
        return rows, params, tokens

    def admit(self, seqs) -> None:
        # the speculator prefills the draft while the target prefills here
        self.link.send_admit(*self._admit_message(seqs))
        admit_with_first_token(self.target, seqs, self.device)
        self._exchange(seqs, [(0, q.tokens[-1]) for q in seqs], first=True)

    def _alive(self, q) -> bool:
        return not q.finished and (self.limit is None or len(q.tokens) < self.limit)

    def _exchange(self, seqs, outcomes, first: bool = False) -> None:
        """Send (slot, k, t*, active) per row and receive the next speculation of the live ones."""
        alive = [self._alive(q) for q in seqs]
        rows = [[q.slot, k, t, int(a)] for q, (k, t), a in zip(seqs, outcomes, alive)]
        rows += [[slot, 0, 0, 0] for slot in self._leaving]
        self._leaving = []
        out = torch.tensor(rows, dtype=torch.int64)
        sampling = any(a and not q.params.greedy for q, a in zip(seqs, alive))
        self.link.send_outcome(out.to(self.device), sampling)
        for q, a in zip(seqs, alive):
            if not a:
                self.spec.pop(q.slot, None)
        if not any(alive):
            idle, busy, hits, _, reused = self.link.recv_stats()
            self._batch_metrics = {
                "speculator_idle_frac": idle / (idle + busy) if idle + busy else 0.0,
                "branch_kv_reused_frac": reused / hits if hits else 0.0}
            return
        t0 = time.perf_counter()
        spec = self.link.recv_spec(out.shape[0], sampling)
        kinds, hits = torch.stack([spec.kinds, spec.hit.long()]).tolist()  # one read-back
        if first:  # admission (a round's wait is timed by the round's timer)
            waited = time.perf_counter() - t0
            for q in seqs:
                q.metrics["wait_s"] = q.metrics.get("wait_s", 0.0) + waited
        for i, (q, (k, _), a) in enumerate(zip(seqs, outcomes, alive)):
            if not a:
                continue
            self.spec[q.slot] = (spec.tokens[i], kinds[i], None if spec.q is None else spec.q[i])
            if self.use_cache and not first:  # a first speculation cannot come from the cache
                record_lookup(q.metrics, k, bool(hits[i]), kinds[i])

    def step(self, active) -> None:
        timer = self.timer
        timer.start()
        tokens = torch.stack([self.spec[q.slot][0] for q in active])  # [b, K]
        draft_q = None
        if not all(q.params.greedy for q in active):
            kinds, probs = [], []
            for q in active:
                _, kind, q_probs = self.spec[q.slot]
                if q_probs is None:
                    # received in an exchange without sampling rows: a greedy row, whose draft
                    # tokens are argmaxes, i.e. drawn from a one-hot q
                    if kind == QKind.DENSE:
                        kind = int(QKind.ONEHOT)
                    q_probs = torch.zeros(self.k, self.link.vocab_size, device=self.device)
                kinds.append(kind)
                probs.append(q_probs)
            draft_q = DraftQ.per_row(kinds, torch.stack(probs).to(self.device))
        outcome = verify_round(self.target, active, tokens, draft_q, self.device)
        result = read_round(tokens, outcome)
        timer.mark("verify")
        commit_round(active, result)
        record_acceptance(active, result, self.k)
        timer.mark("host")
        self._exchange(active, list(zip(result.accepted, result.bonus)))
        timer.mark("wait")  # the next speculation is in hand (at once on a cache hit)
        timer.add_to(active)

    def release(self, seq) -> None:
        if self.spec.pop(seq.slot, None) is not None:
            self._leaving.append(seq.slot)  # tell the speculator with the next outcome

    def batch_metrics(self) -> dict:
        return dict(self._batch_metrics)

    def close(self) -> None:
        self.link.send_shutdown()


def build_ssd_verifier(cfg, world, target, target_ck):
    check_draft_compatible(target_ck, load_checkpoint(cfg.draft))
    link = SpecLink(world.spec_group, world.speculator_rank, world.device, cfg.max_batch, cfg.k,
                    target_ck.config.vocab_size, staged=world.spec_staged)
    loop = SSDVerifier(target, link, cfg.k, world.device, use_cache=cfg.mode == "ssd")
    return loop, loop.close
