"""Mode ``sd``: plain speculative decoding, the draft on the leader rank (the paper's SD baseline).

Each round: the draft proposes K tokens per row, the target verifies K+1 positions in one
forward, the exact rule accepts a prefix k and picks t*, both models keep only committed KV.
"""

from __future__ import annotations

from ssdlib.engine.drafter import Drafter
from ssdlib.engine.leader.ar_loop import admit_with_first_token
from ssdlib.engine.leader.metrics import record_acceptance
from ssdlib.engine.leader.verifier import build_link_verifier
from ssdlib.engine.leader.verify import commit_round, read_round, verify_round
from ssdlib.engine.runner.model_runner import ModelRunner
from ssdlib.engine.timing import RoundTimer
from ssdlib.loading.draft import load_draft
from ssdlib.speculative.acceptance import DraftQ


class SDLoop:
    def __init__(self, target, drafter: Drafter, k: int, device):
        self.target = target
        self.drafter = drafter
        self.k = k
        self.device = device
        self.lookahead = k + 1
        self.timer = RoundTimer(device)

    def admit(self, seqs) -> None:
        admit_with_first_token(self.target, seqs, self.device)
        for q in seqs:
            self.drafter.reset(q.slot)

    def step(self, seqs) -> None:
        timer = self.timer
        timer.start()
        greedy = all(s.params.greedy for s in seqs)
        tokens, q = self.drafter.propose(seqs, self.k, want_q=not greedy)
        timer.mark("draft")
        timer.flush()  # the last round's phases, read while the draft runs
        draft_q = None if greedy else DraftQ.from_probs(q)
        outcome = verify_round(self.target, seqs, tokens, draft_q, self.device)
        result = read_round(tokens, outcome)
        timer.mark("verify")
        commit_round(seqs, result)
        self.drafter.after_commit(seqs, result.accepted, self.k)
        record_acceptance(seqs, result, self.k)
        timer.mark("host")
        timer.add_to(seqs, defer=True)


def build_sd_loop(cfg, world, target, target_ck):
    if cfg.draft_placement == "separate":
        # the draft on its own rank (a Speculator without a cache), speculations over the SSD link
        return build_link_verifier(cfg, world, target, target_ck)
    draft_ck = load_draft(cfg.draft, target_ck)  # checks compatibility
    runner = ModelRunner(draft_ck, None, world.device, cfg.torch_dtype, cfg.max_batch, cfg.max_len,
                         cuda_graphs=cfg.cuda_graphs, compile=cfg.compile)
    loop = SDLoop(target, Drafter(runner, target_ck.config.vocab_size), cfg.k, world.device)
    return loop, lambda: None
