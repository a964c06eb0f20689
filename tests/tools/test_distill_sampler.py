"""tools/distill/sampler.py: finished rows leaving the batch, bucketed key spans, chunked
prefill, per-row temperatures and the deadline keep each row's tokens those of the target."""

import time

import pytest
import torch

from ssdlib.loading import load_checkpoint
from ssdlib.models.llama import LlamaForCausalLM
from tests.tiny import make_tiny_llama
from tools.distill import sampler

PROMPTS = [[5, 6, 7], [9], [3, 1, 4, 1, 5], [11, 12], [40, 41, 42, 43], [7], [8, 9, 10]]
N = 40  # > 2 * CHECK_EVERY: rows leave the batch at two checks


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    target = make_tiny_llama(str(tmp_path_factory.mktemp("sampler") / "t"), "gqa", scale=2.0)
    ck = load_checkpoint(target)
    m = LlamaForCausalLM(ck.config, max_positions=128)
    m.load_weights(ck.weights)
    return m.eval()


def greedy_reference(model, prompt, n, stops=()):
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model.forward_full(torch.tensor([ids]))[0, -1].argmax()))
            if ids[-1] in stops:
                return ids[len(prompt):], True
    return ids[len(prompt):], False


def test_rows_that_stop_leave_the_batch_and_the_rest_are_unchanged(model, monkeypatch):
    free = [greedy_reference(model, p, N)[0] for p in PROMPTS]
    # stops that end some rows early, some late, some never
    stops = {free[0][2], free[1][20]}
    want = [greedy_reference(model, p, N, stops) for p in PROMPTS]
    assert any(s for _, s in want) and any(not s for _, s in want)
    monkeypatch.setattr(sampler, "PREFILL_TOKENS", 8)  # several prefill chunks
    monkeypatch.setattr(sampler, "KV_BUCKET", 4)
    stats = {}
    got = sampler.generate(model, PROMPTS, N, 0.0, stop_ids=sorted(stops), batch_size=5,
                           stats=stats)
    assert got == want
    assert stats["batches"] == 2 and stats["row_steps"] < stats["forwards"] * 5


def test_per_row_temperatures(model):
    free = [greedy_reference(model, p, 12)[0] for p in PROMPTS]
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.0, 0.0]
    gen = torch.Generator().manual_seed(0)
    got = sampler.generate(model, PROMPTS, 12, temps, top_p=0.9, gen=gen, batch_size=4)
    for (new, stopped), t, ref in zip(got, temps, free):
        assert len(new) == 12 and not stopped
        if t == 0.0:
            assert new == ref
    assert any(new != ref for (new, _), ref in zip(got, free))  # sampled rows do sample


def test_per_row_sample_next_draws_from_the_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 0.5]])
    n = 20000
    temps = torch.tensor([0.0, 1.0]).repeat(n)
    tok = sampler.sample_next(logits.expand(2 * n, 4), temps, 1.0,
                              torch.Generator().manual_seed(0))
    assert torch.all(tok[0::2] == 2)
    freq = torch.bincount(tok[1::2], minlength=4).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0], -1), atol=0.015), freq


def test_deadline(model):
    stats = {}
    got = sampler.generate(model, PROMPTS, N, 0.0, batch_size=4, stats=stats,
                           deadline=time.monotonic() - 1)
    assert got == [([], False)] * len(PROMPTS) and stats["skipped"] == len(PROMPTS)


def test_captured_decode_steps_sample_the_same(model, monkeypatch):
    """graphs=True (DecodeGraphs; plain calls on a CPU) gives the uncaptured path's tokens:
    greedy rows that stop at different steps (the live rows shrink past row counts and are
    padded with finished or unused slots), a smaller last batch, and sampled rows drawn from the
    same generator state."""
    free = [greedy_reference(model, p, N)[0] for p in PROMPTS]
    stops = sorted({free[0][2], free[1][20]})
    monkeypatch.setattr(sampler, "KV_BUCKET", 4)
    monkeypatch.setattr(sampler, "GRAPH_ROWS_MIN", 1)  # row counts 1, 4, 5: padding happens
    made = []
    real = sampler.DecodeGraphs

    class Spy(real):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(sampler, "DecodeGraphs", Spy)
    want = sampler.generate(model, PROMPTS, N, 0.0, stop_ids=stops, batch_size=5)
    got = sampler.generate(model, PROMPTS, N, 0.0, stop_ids=stops, batch_size=5, graphs=True)
    assert got == want
    steps = made[0]
    assert steps.counts == [1, 4, 5] and steps.cache.n_slots == 5
    rows = {key[0] for key in steps.pool.keys()}
    assert {1, 4, 5} & rows and len(rows) >= 2, rows  # shrank past a row count
    temps = [0.0, 1.0, 0.0, 0.7, 0.0, 1.0, 0.0]
    runs = [sampler.generate(model, PROMPTS, 24, temps, top_p=0.9, stop_ids=stops,
                             gen=torch.Generator().manual_seed(3), batch_size=4, graphs=g)
            for g in (False, True)]
    assert runs[0] == runs[1]
