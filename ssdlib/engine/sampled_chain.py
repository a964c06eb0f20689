"""The draft's sampled proposal as one chain of device work (one graph replay on GPU).

A proposal of k tokens for rows that sample (SD's draft at temperature > 0, SSD's jit fallback):
a forward over the committed tokens the draft has not seen, then for j = 0 .. k-1 the row's
target distribution q_j of the draft's logits (:func:`~ssdlib.sampling.target_distributions`,
one-hot on greedy rows), token j drawn from q_j with draw j of the row's stream
(:func:`~ssdlib.engine.sampler.draw_tokens`; the argmax on greedy rows), and a single-token
forward of token j (not after the last). Returns tokens [b, k] and q [b, k, V].

Everything after the host's inputs is device work: the rows' parameters (a [rows, 4] float64
table) and stream positions ([rows, 2] int64: key, first counter of the k draws reserved on the
host) are inputs like the token ids, and what the host knows of the parameters
(:class:`~ssdlib.sampling.SamplingFacts`) is part of the captured step's key
(``StepGraphs.sampled_chain``). Without graphs, or when the unseen tokens fit no step graph (a
new sequence's prompt), the same body runs eagerly, the first forward through
``ModelRunner.forward``.

Logits of a draft whose vocabulary differs from the target's ``vocab`` are cut to it or padded
with -inf (:func:`fit_vocab`): the draft never proposes a token the target does not have.
"""

from __future__ import annotations

import torch

from ssdlib.engine.sampler import draw_tokens
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.sampling import SamplingFacts, SamplingTensors, target_distributions
from ssdlib.speculative.rng import RowStreams


def fit_vocab(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """logits [..., v] -> [..., vocab]: cut, or padded with -inf (tokens the model lacks)."""
    v = logits.shape[-1]
    if v > vocab:
        return logits[..., :vocab]
    if v < vocab:
        pad = logits.new_full((*logits.shape[:-1], vocab - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


def draw_steps(runner, logits, after, slots, steps: int, vocab: int, kv_len: int,
               use_kernel: bool, table, streams, facts: SamplingFacts):
    """From the first logits [rows, v] (device): draw a token, then ``steps`` times a forward
    of the last token at ``after`` + j and a draw -> (tokens [rows, steps + 1], q
    [rows, steps + 1, vocab] float32). ``table`` [rows, 4] and ``streams`` [rows, 2] on the
    device (static buffers when captured: read here, at every replay)."""
    params = SamplingTensors.from_table(table, facts)
    u = RowStreams(streams[:, 0], streams[:, 1], steps + 1).uniforms(steps + 1)  # [rows, k]

    def step(tok: torch.Tensor, j: int) -> torch.Tensor:
        pos = (after + j).view(-1, 1)
        meta = AttentionMetadata(pos, slots, kv_len, kv_limit=pos + 1, use_kernel=use_kernel)
        return runner.step_model(tok.view(-1, 1), runner.cache, meta)[:, 0]
    return draw_chain(logits, steps + 1, vocab, params, u, step)


def draw_chain(logits: torch.Tensor, k: int, vocab: int, params: SamplingTensors,
               u: torch.Tensor, step) -> tuple[torch.Tensor, torch.Tensor]:
    """k sampled drafts a row from the first logits [rows, v]: draft j drawn from the row's
    target distribution q_j with ``u[:, j]`` (one-hot q and the argmax on greedy rows), then
    ``step(draft j, j)`` -> the next logits (not after the last) -> (tokens [rows, k], q
    [rows, k, vocab] float32). Every sampled proposal (a standalone draft's, a feature draft's
    in SD and as SSD's jit draft) draws through it."""
    tokens, qs = [], []
    for j in range(k):
        logits = fit_vocab(logits, vocab)
        q = target_distributions(logits, params)  # [rows, vocab] float32
        tok = draw_tokens(q, logits, params, u[:, j])
        tokens.append(tok)
        qs.append(q)
        if j < k - 1:
            logits = step(tok, j)
    return torch.stack(tokens, dim=1), torch.stack(qs, dim=1)


def sampled_chain_body(runner, ids, positions, slots, index, steps: int, vocab: int,
                       kv_len: int, use_kernel: bool, table, streams, facts: SamplingFacts):
    """The captured step's body, on device tensors: the forward over ``ids`` [rows, s], its
    logits at ``index`` [rows, 1], then :func:`draw_steps`."""
    meta = AttentionMetadata(positions, slots, kv_len, kv_limit=positions + 1,
                             use_kernel=use_kernel)
    logits = runner.step_model(ids, runner.cache, meta, index)[:, 0]
    after = positions.gather(1, index)[:, 0] + 1  # the first drawn token's position
    return draw_steps(runner, logits, after, slots, steps, vocab, kv_len, use_kernel, table,
                      streams, facts)


@torch.inference_mode()
def sampled_chain(runner, ids, positions, slots, logits_index, steps: int, vocab: int,
                  table: torch.Tensor, streams: torch.Tensor, facts: SamplingFacts):
    """The sampled proposal of ``steps`` + 1 tokens a row (module doc). ids / positions
    [b, s], slots [b], logits_index [b, 1] (each row's last unseen token), ``table``
    (``SamplingTensors.host_table``) and ``streams`` ([b, 2]: key, first reserved counter) on
    the host -> (tokens [b, steps + 1], q [b, steps + 1, vocab]) on the device."""
    b, s = ids.shape
    graphs = runner.graphs
    prefill = runner.prefill_first(ids, positions, logits_index)  # a prompt: its own graphs
    ids, positions = runner.step_queries(ids, positions, logits_index, catch_up=True)
    kv_len = runner.kv_bucket(int(positions.max()) + steps + 1)
    if graphs is not None and graphs.fits(b, s) and not prefill:
        return graphs.sampled_chain(ids, positions, slots, logits_index, steps, vocab, kv_len,
                                    table, streams, facts)
    dev = runner.device
    logits = runner.forward(ids, positions, slots, logits_index)[:, 0]
    after = positions.gather(1, logits_index)[:, 0] + 1
    if graphs is not None and graphs.fits(b, 1) and steps > 0:
        # the prompt fit no step graph: draw the first token here, the rest in the chain's
        # graph (single-token steps), from the stream's next draw
        first, q0 = draw_steps(runner, logits, None, None, 0, vocab, kv_len, False,
                               table.to(dev), streams.to(dev), facts)
        later = streams.clone()
        later[:, 1] += 1
        rest, q_rest = graphs.sampled_chain(first, after.view(-1, 1), slots,
                                            torch.zeros(b, 1, dtype=torch.int64), steps - 1,
                                            vocab, kv_len, table, later, facts)
        return torch.cat([first, rest], dim=1), torch.cat([q0, q_rest], dim=1)
    return draw_steps(runner, logits, after.to(dev), slots.to(dev), steps, vocab, kv_len, False,
                      table.to(dev), streams.to(dev), facts)
