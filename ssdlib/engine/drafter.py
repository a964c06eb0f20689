"""The draft model proposing K tokens per row autoregressively (SD, and SSD's jit fallback).

The draft's KV cache is kept in step with the committed tokens lazily: ``valid[slot]`` counts the
leading committed tokens whose KV is correct. Each proposal first feeds the committed tokens the
draft has not seen (usually 1, or 2 after a fully accepted round), then K-1 single-token steps.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import last_index, pack_rows, prefill, slots_tensor
from ssdlib.engine.sampled_chain import fit_vocab, sampled_chain
from ssdlib.sampling import SamplingTensors
from ssdlib.speculative.rng import RowStreams


class Drafter:
    def __init__(self, runner, vocab_size: int):
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: draft logits are cut/padded to it
        self.valid: dict[int, int] = {}

    def reset(self, slot: int) -> None:
        self.valid[slot] = 0

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits, self.vocab_size)

    @torch.inference_mode()
    def prefill(self, seqs) -> None:
        """Feed every committed token of ``seqs`` into the draft KV."""
        prefill(self.runner, seqs)
        for q in seqs:
            self.valid[q.slot] = len(q.tokens)

    @torch.inference_mode()
    def propose(self, seqs, k: int, want_q: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft k tokens per row. Returns tokens [b, k] (on the device) and q [b, k, V]
        (float32; one-hot on greedy rows), or None for q when every row is greedy and
        ``want_q`` is False. Greedy batches run without host syncs: each step's argmax feeds
        the next step on the device."""
        rows = [q.tokens[self.valid.get(q.slot, 0):] for q in seqs]
        starts = [self.valid.get(q.slot, 0) for q in seqs]
        ids, pos = pack_rows(rows, starts)
        slots = slots_tensor(seqs)
        index = last_index([len(r) for r in rows])
        if all(s.params.greedy for s in seqs):
            tokens, q = self._greedy(ids, pos, slots, index, k, want_q)
        else:
            tokens, q = self._sampled(ids, pos, slots, index, seqs, k)
        for s in seqs:
            # KV now holds the committed tokens plus the first k-1 drafted ones
            self.valid[s.slot] = len(s.tokens) + k - 1
        return tokens, q

    def _greedy(self, ids, positions, slots, index, k: int, want_q: bool):
        """Argmax drafting: the unseen tokens' forward and the k-1 steps after it as one chain
        (one graph replay on GPU). The argmax runs over the tokens both vocabularies have (the
        target's extra rows would be -inf, the draft's extra rows are cut)."""
        v = min(self.vocab_size, self.runner.config.vocab_size)
        tokens = self.runner.prefix_chain(ids, positions, slots, index, k - 1, v)
        q = None
        if want_q:  # argmax tokens were drawn from one-hot q
            q = torch.zeros(*tokens.shape, self.vocab_size, device=tokens.device)
            q.scatter_(-1, tokens.unsqueeze(-1), 1.0)
        return tokens, q

    def _sampled(self, ids, positions, slots, index, seqs, k: int):
        """Each token drawn from the row's target distribution of the draft's logits with the
        row's stream (draw j for token j), as one chain (``sampled_chain.py``: one graph
        replay on GPU)."""
        params = [s.params for s in seqs]
        streams = RowStreams.reserve_host([s.stream for s in seqs], k)
        return sampled_chain(self.runner, ids, positions, slots, index, k - 1, self.vocab_size,
                             SamplingTensors.host_table(params), streams,
                             SamplingTensors.host_facts(params))

    def after_commit(self, seqs, accepted: list[int], k: int) -> None:
        """Keep draft KV only for committed tokens: prefix + accepted drafts (never the bonus)."""
        for s, a in zip(seqs, accepted):
            # committed = old prefix n + a accepted + bonus; the draft fed s_1..s_{k-1} only
            self.valid[s.slot] = len(s.tokens) - a - 1 + min(a, k - 1)
