"""The verifier side of SSD (leader rank): verify the speculation in hand, send the outcome,
receive the next speculation (at once on a cache hit).

Static batch: a batch is admitted when none is running; rows leave as they finish.
"""

from __future__ import annotations

import time

import torch

from ssdlib.engine.ar_loop import prefill
from ssdlib.engine.metrics import record_acceptance, record_lookup
from ssdlib.engine.protocol import SpecLink
from ssdlib.engine.sampler import sample_rows
from ssdlib.engine.verify import commit_outcome, verify_round
from ssdlib.loading import load_checkpoint
from ssdlib.loading.compat import check_draft_compatible
from ssdlib.speculative.acceptance import DraftQ


class SSDVerifier:
    def __init__(self, target, link: SpecLink, k: int, device):
        self.target = target
        self.link = link
        self.k = k
        self.device = device
        self.lookahead = k + 1
        self.limit: int | None = None  # set by the Leader
        self.rows: list = []
        self.spec = None
        self.sampling = False

    def can_admit(self, active) -> bool:
        return not active

    def _rows_message(self, seqs):
        rows = torch.tensor([[q.slot, len(q.tokens), q.request.index,
                              -1 if q.params.seed is None else q.params.seed] for q in seqs],
                            dtype=torch.int64)
        params = torch.tensor([[q.params.temperature, q.params.top_p, float(q.params.top_k)]
                               for q in seqs], dtype=torch.float64)
        tokens = torch.tensor([t for q in seqs for t in q.tokens], dtype=torch.int64)
        return rows, params, tokens

    def admit(self, seqs) -> None:
        self.rows = list(seqs)
        self.sampling = not all(q.params.greedy for q in seqs)
        # the speculator prefills the draft while the target prefills here
        self.link.send_admit(*self._rows_message(seqs), self.sampling)
        logits = prefill(self.target, seqs, self.device)
        for q, t in zip(seqs, sample_rows(logits, seqs)):
            q.commit([t])
        self._exchange([(0, q.tokens[-1]) for q in seqs], first=True)

    def _alive(self, q) -> bool:
        return not q.finished and (self.limit is None or len(q.tokens) < self.limit)

    def _exchange(self, outcomes, first: bool = False) -> None:
        """Send (k, t*) per row (inactive rows flagged) and receive the next speculation."""
        out = torch.tensor([[k, t, int(self._alive(q))] for q, (k, t) in zip(self.rows, outcomes)],
                           dtype=torch.int64)
        self.link.send_outcome(out.to(self.device))
        t0 = time.perf_counter()
        if not bool(out[:, 2].any()):
            idle, busy, hits, _, reused = self.link.recv_stats()
            self._batch_metrics = {
                "speculator_idle_frac": idle / (idle + busy) if idle + busy else 0.0,
                "branch_kv_reused_frac": reused / hits if hits else 0.0}
            self.spec = None
            return
        self.spec = self.link.recv_spec(len(self.rows), self.sampling)
        waited = time.perf_counter() - t0
        for q, (k, _), hit, kind in zip(self.rows, outcomes, self.spec.hit.tolist(),
                                        self.spec.kinds.tolist()):
            if self._alive(q):
                q.metrics["wait_s"] = q.metrics.get("wait_s", 0.0) + waited
                if not first:  # the first speculation of a batch cannot come from the cache
                    record_lookup(q.metrics, k, bool(hit), int(kind))

    def step(self, active) -> None:
        t0 = time.perf_counter()
        idx = [self.rows.index(q) for q in active]
        sel = torch.tensor(idx, device=self.spec.tokens.device)
        tokens = self.spec.tokens[sel]
        draft_q = None
        if self.sampling:
            draft_q = DraftQ.per_row(self.spec.kinds[sel].to(self.device),
                                     self.spec.q[sel].to(self.device))
        outcome = verify_round(self.target, active, tokens, draft_q, self.device)
        ks = commit_outcome(active, tokens, outcome)
        record_acceptance(active, outcome, self.k)
        t1 = time.perf_counter()
        for q in active:
            q.metrics["verify_s"] = q.metrics.get("verify_s", 0.0) + (t1 - t0)
        by_row = dict(zip(idx, zip(ks, outcome.bonus.tolist())))
        self._exchange([by_row.get(i, (0, 0)) for i in range(len(self.rows))])

    def batch_metrics(self) -> dict:
        return dict(getattr(self, "_batch_metrics", {}))

    def close(self) -> None:
        self.link.send_shutdown()


def build_ssd_verifier(cfg, world, target, target_ck):
    check_draft_compatible(target_ck, load_checkpoint(cfg.draft))
    link = SpecLink(world.spec_group, world.speculator_rank, world.device, cfg.max_batch, cfg.k,
                    target_ck.config.vocab_size)
    loop = SSDVerifier(target, link, cfg.k, world.device)
    return loop, loop.close
