"""The draft model proposing K tokens per row autoregressively (SD, and SSD's jit fallback).

The draft's KV cache is kept in step with the committed tokens lazily: ``valid[slot]`` counts the
leading committed tokens whose KV is correct. Each proposal first feeds the committed tokens the
draft has not seen (1, or 2 after a fully accepted round; at least the last 2, so that the
chain has one shape either way), then K-1 single-token steps.

Rounds that draft nothing (adaptive K = 0: the target decodes alone) leave the draft behind;
:meth:`Drafter.skip` notes them, and the next proposal first catches those rows up
(:meth:`Drafter.catch_up`), as it does a new sequence's prompt, so that the proposal's own chain
starts from the usual one or two unseen tokens: the shapes of a proposal's chain depend on k
only, which the warm-up runs through.
"""

from __future__ import annotations

import torch

from ssdlib.engine.batching import last_index, pack_rows, prefill, slots_tensor
from ssdlib.engine.sampled_chain import fit_vocab, sampled_chain
from ssdlib.sampling import SamplingTensors, one_hot
from ssdlib.speculative.rng import RowStreams

# positions a row of the draft's catch-up forward holds (padded; a longer gap takes several)
CATCH_UP_QUERIES = 32
# committed tokens a proposal's chain feeds (the unseen ones: 1, or 2 after a fully accepted
# round; a seen one again to make 2); a row further behind is caught up first
CHAIN_UNSEEN = 2


class Drafter:
    def __init__(self, runner, vocab_size: int, draws: int = 0):
        self.runner = runner
        self.vocab_size = vocab_size  # the target's: draft logits are cut/padded to it
        # draws of a sampled row's stream every proposal reserves (K_max: the same whatever k a
        # round drafts, and in a round that drafts nothing, rng's convention); 0: k
        self.draws = draws
        self.valid: dict[int, int] = {}
        self.lagging: set[int] = set()  # slots skipped by a round since their last proposal
        # the last proposal was k steps of the chain and no more (no prompt, no catch-up): its
        # time measures a draft step
        self.plain = True

    def reset(self, slot: int) -> None:
        self.valid[slot] = 0
        self.lagging.discard(slot)

    def skip(self, seqs) -> None:
        """A round drafts nothing for ``seqs``: their streams still give up a proposal's draws,
        and their next proposal catches the draft up first."""
        for s in seqs:
            s.stream.reserve(self.draws)
            self.lagging.add(s.slot)

    @torch.inference_mode()
    def catch_up(self, seqs) -> None:
        """Before a proposal: rows more than CHAIN_UNSEEN tokens behind get their committed
        tokens but the last fed first, so that the proposal's chain (one step shape per k)
        starts from the usual one or two unseen tokens. A new sequence's prompt goes in one
        forward (a prefill: its shape follows the prompt's length, never k); a row that skipped
        rounds (:meth:`skip`) in forwards of CATCH_UP_QUERIES positions a row (rows padded; the
        padding's KV lands past the row's tokens and is overwritten before it is read): one
        step shape whatever the gap. (A speculator's jit rows, fed up to their last draft,
        are otherwise left to the chain.)"""
        behind = [s for s in seqs if len(s.tokens) - self.valid.get(s.slot, 0) > CHAIN_UNSEEN]
        new = [s for s in behind if self.valid.get(s.slot, 0) == 0]
        late = [s for s in behind if s.slot in self.lagging and self.valid.get(s.slot, 0) > 0]
        self.lagging.difference_update(s.slot for s in seqs)
        self.plain = not (new or late)
        if new:
            lengths = [len(s.tokens) - 1 for s in new]
            starts = [self.first_read(n) for n in lengths]
            ids, pos = pack_rows([s.tokens[st:-1] for s, st in zip(new, starts)], starts)
            self.runner.forward(ids, pos, slots_tensor(new),
                                last_index([n - st for n, st in zip(lengths, starts)]))
            for s, n in zip(new, lengths):
                self.valid[s.slot] = n
        n = CATCH_UP_QUERIES
        for s in late:  # (with a window) the skipped positions no later step reads stay unfed
            self.valid[s.slot] = max(self.valid[s.slot], self.first_read(len(s.tokens) - 1))
        late = [s for s in late if self.valid[s.slot] < len(s.tokens) - 1]
        while late:
            starts = [self.valid[s.slot] for s in late]
            rows = [s.tokens[v:min(v + n, len(s.tokens) - 1)] for s, v in zip(late, starts)]
            ids, _ = pack_rows(rows, starts)
            ids = torch.nn.functional.pad(ids, (0, n - ids.shape[1]))
            pos = torch.tensor(starts, dtype=torch.int64).view(-1, 1) + torch.arange(n)
            self.runner.forward(ids, pos, slots_tensor(late))  # only the KV is wanted
            for s, r in zip(late, rows):
                self.valid[s.slot] += len(r)
            late = [s for s in late if self.valid[s.slot] < len(s.tokens) - 1]

    def _logits(self, logits: torch.Tensor) -> torch.Tensor:
        return fit_vocab(logits, self.vocab_size)

    def first_read(self, n: int) -> int:
        """The first of ``n`` committed positions whose KV a later draft step can read: 0, or
        with a sliding window the first within its reach (``ModelConfig.context_reach``) of the
        positions the next proposal feeds again (CHAIN_UNSEEN). A prefill from there leaves
        exactly the KV that a prefill of every token leaves at the positions read later, and a
        6k-token prompt's prefill of the default draft takes half the time (one H200:
        ``dev/prefill_probe.py``)."""
        reach = self.runner.config.context_reach
        return 0 if reach is None else max(0, n - CHAIN_UNSEEN - reach)

    @torch.inference_mode()
    def prefill(self, seqs) -> None:
        """Feed the committed tokens of ``seqs`` that later steps can read (:meth:`first_read`:
        every one without a sliding window) into the draft KV."""
        prefill(self.runner, seqs, [self.first_read(len(q.tokens)) for q in seqs])
        for q in seqs:
            self.valid[q.slot] = len(q.tokens)

    @torch.inference_mode()
    def propose(self, seqs, k: int, want_q: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft k tokens per row. Returns tokens [b, k] (on the device) and q [b, k, V]
        (float32; one-hot on greedy rows), or None for q when every row is greedy and
        ``want_q`` is False. Greedy batches run without host syncs: each step's argmax feeds
        the next step on the device."""
        self.catch_up(seqs)
        # at least CHAIN_UNSEEN tokens a row (one seen token fed again, its KV rewritten): the
        # chain's first forward has one shape whether the last round accepted everything or not
        starts = [max(0, min(self.valid.get(q.slot, 0), len(q.tokens) - CHAIN_UNSEEN))
                  for q in seqs]
        rows = [q.tokens[st:] for q, st in zip(seqs, starts)]
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
        return tokens, (one_hot(tokens, self.vocab_size) if want_q else None)

    def _sampled(self, ids, positions, slots, index, seqs, k: int):
        """Each token drawn from the row's target distribution of the draft's logits with the
        row's stream (draw j for token j), as one chain (``sampled_chain.py``: one graph
        replay on GPU)."""
        params = [s.params for s in seqs]
        streams = RowStreams.reserve_host([s.stream for s in seqs], max(k, self.draws))
        return sampled_chain(self.runner, ids, positions, slots, index, k - 1, self.vocab_size,
                             SamplingTensors.host_table(params), streams,
                             SamplingTensors.host_facts(params))

    def after_commit(self, seqs, accepted: list[int], k: int) -> None:
        """Keep draft KV only for committed tokens: prefix + accepted drafts (never the bonus)."""
        for s, a in zip(seqs, accepted):
            # committed = old prefix n + a accepted + bonus; the draft fed s_1..s_{k-1} only
            self.valid[s.slot] = len(s.tokens) - a - 1 + min(a, k - 1)
