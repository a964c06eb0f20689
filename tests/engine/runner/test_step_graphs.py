"""Captured steps (StepGraphs: static buffers, batch buckets, ghost rows) == the eager forward.

On CPU the pool is the eager one (same code path as ``cuda_graphs=False``); on CUDA the same
checks run with real graph replay (fp32, token-identical logits up to kernel rounding).
"""

import pytest
import torch

from ssdlib.engine.runner.model_runner import ModelRunner
from ssdlib.engine.runner.static_inputs import batch_bucket
from ssdlib.engine.runner.step_graphs import StepGraphs
from ssdlib.loading import load_checkpoint


def runners(path, device, pool_kind):
    from ssdlib.ops.graph_pool import EagerPool, make_graph_pool

    ck = load_checkpoint(path)
    eager = ModelRunner(ck, None, device, torch.float32, n_slots=6, max_len=96, tree_len=24)
    eager.graphs = None
    stepped = ModelRunner(ck, None, device, torch.float32, n_slots=6, max_len=96, tree_len=24)
    # "warm": the eager pool running each step twice when registered, like a graph pool's
    # warm-up (a captured body must give the same result however often it runs)
    # "all": as "warm", and every batch bucket is captured at a step's first use (compile=True)
    pool = (EagerPool() if pool_kind == "eager"
            else EagerPool(warmup=2) if pool_kind in ("warm", "all")
            else make_graph_pool(torch.device(device), True))
    stepped.graphs = StepGraphs(stepped, pool, 6, 16, 24,
                                all_buckets=pool_kind in ("all", "graph-all"))
    return ck, eager, stepped


def kinds():
    out = [("cpu", "eager"), ("cpu", "warm"), ("cpu", "all")]
    if torch.cuda.is_available():  # real graphs, captured one bucket or all at once
        out += [("cuda", "graph"), ("cuda", "graph-all")]
    return out


def stepwise_tree(runner, cand, sent, n, slots, pos, rank, kv_len, pick):
    """The reference for the build steps: the branch outcomes, then one ``tree_forward`` per
    depth on ``runner``, ``pick(d, logits)`` choosing every branch's next token; yields
    (depth, tokens [b, B])."""
    from ssdlib.engine.speculator.tree_build import branch_outcomes
    from ssdlib.ops.tree_mask import tree_mask_full

    dev = cand.device
    b, K, B = cand.shape[0], sent.shape[1], pos.shape[0]
    fork, tok = branch_outcomes(cand, sent.to(dev), pos, rank)
    kv_limit = torch.tensor(n, device=dev).view(-1, 1) + fork
    full = tree_mask_full(fork, K, K)[..., K:]
    for d in range(K):
        lg = runner.tree_forward(tok, kv_limit + d, torch.tensor(slots),
                                 (d * B + torch.arange(B)).expand(b, B), kv_limit,
                                 full[:, d * B:(d + 1) * B, :B * (d + 1)], kv_len)
        tok = pick(d, lg)
        yield d, tok


def test_batch_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 8, 9, 17)] == [1, 2, 4, 8, 8, 16, 24]


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_steps_equal_eager(tiny_dirs, device, pool_kind):
    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(0)
    lens = [9, 14, 5]  # b = 3: bucket 4, one ghost row
    slots = torch.tensor([4, 0, 2])
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    from ssdlib.engine.batching import last_index, pack_rows

    ids, pos = pack_rows(prompts, [0, 0, 0])
    for r in (eager, stepped):  # prefill (eager in both)
        r.forward(ids, pos, slots, last_index(lens))
    for step in range(6):  # decode then verify-shaped steps, ragged positions
        s = 1 if step < 3 else 4
        new = torch.randint(0, V, (3, s), generator=g)
        p = torch.tensor(lens).view(-1, 1) + torch.arange(s)
        a = eager.forward(new, p, slots)
        b = stepped.forward(new, p, slots)
        assert (a - b).abs().max().item() <= 1e-4, (step, (a - b).abs().max().item())
        lens = [n + s for n in lens]
    # the ghost rows wrote only to the scratch slot: every real slot's cache (the unused ones
    # too) is identical
    for i in range(6):
        assert torch.allclose(eager.cache.k[:, i], stepped.cache.k[:, i], atol=1e-5), i
        assert torch.allclose(eager.cache.v[:, i], stepped.cache.v[:, i], atol=1e-5), i
    if pool_kind in ("all", "graph-all"):  # every bucket up to the runner's (8 for 6 slots)
        keys = set(stepped.graphs.pool.keys())
        assert {k[1] for k in keys} == {1, 2, 4, 8}
        shapes = {k[2:] for k in keys}  # (queries, logits rows, ...): prefill, decode, verify
        assert {(1, 0), (4, 0)} <= {sh[:2] for sh in shapes}
        assert keys == {("fwd", r) + sh for r in (1, 2, 4, 8) for sh in shapes}


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_tree_steps_equal_eager(tiny_dirs, device, pool_kind):
    from ssdlib.ops.tree_mask import tree_mask_full

    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    V, K, B = ck.config.vocab_size, 3, 4
    g = torch.Generator().manual_seed(1)
    lens = [11, 7]
    slots = torch.tensor([1, 3])
    from ssdlib.engine.batching import last_index, pack_rows

    ids, pos = pack_rows([torch.randint(0, V, (n,), generator=g).tolist() for n in lens], [0, 0])
    for r in (eager, stepped):
        r.forward(ids, pos, slots, last_index(lens))
    fork = torch.tensor([[0, 0, 1, 3], [0, 2, 2, 3]])
    kv_limit = torch.tensor(lens).view(-1, 1) - K + fork  # prefix ends K before the length
    full = tree_mask_full(fork, K, K)[..., K:]
    for d in range(K):
        tok = torch.randint(0, V, (2, B), generator=g)
        tree_index = (d * B + torch.arange(B)).expand(2, B)
        args = (tok, kv_limit + d, slots, tree_index, kv_limit,
                full[:, d * B:(d + 1) * B, :B * (d + 1)], max(lens))
        a = eager.tree_forward(*args)
        b = stepped.tree_forward(*args)
        assert (a - b).abs().max().item() <= 1e-4, (d, (a - b).abs().max().item())


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_greedy_chain_equals_step_by_step(tiny_dirs, device, pool_kind):
    """The draft's K-1 greedy steps captured as one chain == one forward + argmax per step."""
    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(2)
    lens = [10, 6, 13]
    slots = torch.tensor([5, 1, 3])
    from ssdlib.engine.batching import last_index, pack_rows

    ids, pos = pack_rows([torch.randint(0, V, (n,), generator=g).tolist() for n in lens], [0] * 3)
    first = None
    for r in (eager, stepped):
        first = r.forward(ids, pos, slots, last_index(lens))[:, 0].argmax(-1)
    positions = torch.tensor(lens)
    chain = stepped.greedy_chain(first, positions, slots, 4, V).cpu()
    tok, want = first, []
    for j in range(4):
        logits = eager.forward(tok.view(-1, 1), (positions + j).view(-1, 1), slots)[:, 0]
        tok = logits.argmax(-1)
        want.append(tok.cpu())
    assert chain.tolist() == torch.stack(want, 1).tolist()


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_tree_build_step_equals_eager_and_stepwise(tiny_dirs, device, pool_kind):
    """The speculator's greedy build as one captured step (static inputs, batch bucket 4 for 3
    rows, a ghost row on the scratch slot) == the same body on plain tensors == one
    tree_forward + argmax per depth; two rounds with new inputs (replay reads them afresh)."""
    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.speculator.spec_cache import SpeculationCache
    from ssdlib.engine.speculator.tree_build import TreeBuildStep, branch_outcomes

    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    V, K, C = ck.config.vocab_size, 3, 5
    fan = [2, 1, 1, 0]  # B = 4 branches: 2 fork at 0, 1 at 1, 1 at 2
    B = sum(fan)
    pos = torch.tensor([0, 0, 1, 2], device=device)
    rank = torch.tensor([0, 1, 0, 0], device=device)
    g = torch.Generator().manual_seed(4)
    lens = [12, 8, 10]
    slots = [0, 4, 2]
    ids, p = pack_rows([torch.randint(0, V, (n,), generator=g).tolist() for n in lens], [0] * 3)
    for r in (eager, stepped):
        r.forward(ids, p, torch.tensor(slots), last_index(lens))
    steps, caches = [], []
    for r in (eager, stepped):
        cache = SpeculationCache(7, B, K, V, r.device)  # 6 slots + the scratch slot
        top = torch.zeros(7, B, K, C, dtype=torch.int64, device=r.device)
        steps.append(TreeBuildStep(r, cache, top, C, V))
        caches.append((cache, top))
    assert steps[0].pool is None and steps[1].pool is not None
    for round_ in range(2):
        cand = torch.randint(0, V, (3, K + 1, C), generator=g).to(device)
        sent = torch.randint(0, V, (3, K), generator=g)
        sent[0, 0] = cand[0, 0, 0]  # an excluded candidate (a bonus cannot be s_1)
        n = [x - K + round_ for x in lens]  # committed: the speculation's KV follows
        for step in steps:
            step.run(cand, sent.tolist(), n, slots, pos, rank, max(lens) + K)
        (ca, ta), (cb, tb) = caches
        idx = torch.tensor(slots, device=device)
        for x, y in ((ca.tokens, cb.tokens), (ca.fork, cb.fork), (ca.bonus, cb.bonus), (ta, tb)):
            assert x[idx].cpu().tolist() == y[idx].cpu().tolist(), round_
        assert ca.ready[:6].cpu().tolist() == cb.ready[:6].cpu().tolist()  # 6: scratch
        assert cb.ready[[1, 3, 5]].sum().item() == 0  # the ghost row touched the scratch row only
        # stepwise reference on the eager runner
        fork, first = branch_outcomes(cand, sent.to(device), pos, rank)
        assert (fork[0] == pos).all() and (first[0, 0] != sent[0, 0].to(device))
        for d, tok in stepwise_tree(eager, cand, sent, n, slots, pos, rank, max(lens) + K,
                                    lambda d, lg: lg.argmax(-1)):
            assert cb.tokens[idx, :, d].cpu().tolist() == tok.cpu().tolist(), (round_, d)
    if pool_kind in ("all", "graph-all"):  # the build: every bucket (ghost rows: scratch)
        assert {k[1] for k in steps[1].pool.keys() if k[0] == "tree_build"} == {1, 2, 4, 8}


@pytest.mark.parametrize("sampled", [False, True])
@pytest.mark.parametrize("device,pool_kind", kinds())
def test_tree_build_step_continues_a_hit_branch(tiny_dirs, device, pool_kind, sampled):
    """A row answered from the cache continues its branch in the continuation step (branch KV
    moved from the tree scratch into the slot, kept candidates, s_K fed), next to rows that
    were not hits, before a greedy or a sampled build: == doing those steps by hand on an
    eager runner, then the build with every row's candidates given."""
    from types import SimpleNamespace

    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.speculator.spec_cache import SpeculationCache
    from ssdlib.engine.speculator.tree_build import TreeBuildStep
    from ssdlib.sampling import SamplingParams
    from ssdlib.speculative.rng import RowStream

    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    _, ref, _ = runners(tiny_dirs["smol_heads"], device, "eager")
    V, K, C = ck.config.vocab_size, 3, 5
    fan = [2, 1, 1, 0]
    B = sum(fan)
    pos = torch.tensor([0, 0, 1, 2], device=device)
    rank = torch.tensor([0, 1, 0, 0], device=device)
    g = torch.Generator().manual_seed(6)
    lens, slots = [12, 8, 10], [0, 4, 2]
    ids, p = pack_rows([torch.randint(0, V, (n,), generator=g).tolist() for n in lens], [0] * 3)
    steps, caches = [], []
    for r in (eager, stepped, ref):
        r.forward(ids, p, torch.tensor(slots), last_index(lens))
        cache = SpeculationCache(7, B, K, V, r.device)
        top = torch.zeros(7, B, K, C, dtype=torch.int64, device=r.device)
        steps.append(TreeBuildStep(r, cache, top, C, V))
        caches.append((cache, top))
    # round 0: no hits; every row's speculation follows its committed tokens
    cand = torch.randint(0, V, (3, K + 1, C), generator=g).to(device)
    sent = torch.randint(0, V, (3, K), generator=g)
    n0 = [x - K for x in lens]
    for step in steps:
        step.run(cand, sent.tolist(), n0, slots, pos, rank, max(lens) + K)
    # round 1: row 0 hit branch 2 (fork 1: s_1 accepted, then its t*); rows 1, 2 missed
    j = 2
    cache0 = caches[2][0]
    n1 = [n0[0] + int(pos[j]) + 1, n0[1] + 2, n0[2] + 1]
    sent1 = torch.randint(0, V, (3, K), generator=g)
    sent1[0] = cache0.tokens[slots[0], j].cpu()  # the hit's speculation is the cached branch
    cand1 = torch.randint(0, V, (3, K + 1, C), generator=g).to(device)  # rows 1, 2's
    reuse = [j, -1, -1]

    def how():  # round 1's build: greedy, or sampled with the same streams on every runner
        if not sampled:
            return {}
        rows = [SimpleNamespace(params=SamplingParams(temperature=t),
                                stream=RowStream.from_seed(3, r))
                for r, t in enumerate((0.9, 0.0, 1.1))]
        return dict(sampled_rows=rows, fan=tuple(fan), saguaro_c=0.5)
    for step in steps[:2]:
        step.run(cand1, sent1.tolist(), n1, slots, pos, rank, max(n1) + K, reuse, **how())
    # by hand on `ref`: move the branch KV, take its kept candidates, feed s_K
    kv, (_, ref_top) = ref.cache, caches[2]
    dest = torch.tensor([[n1[0] - 1 + d for d in range(K)]], device=device)
    src = torch.tensor([[d * B + j for d in range(K)]], device=device)
    si = torch.tensor([[slots[0]]], device=device)
    kv.k[:, si, :, dest] = kv.tree_k[:, si, :, src]
    kv.v[:, si, :, dest] = kv.tree_v[:, si, :, src]
    want = cand1.clone()
    want[0, :K] = ref_top[slots[0], j]
    lg = ref.forward(sent1[:1, K - 1:], torch.tensor([[n1[0] + K - 1]]), torch.tensor(slots[:1]))
    want[0, K] = lg[0, 0].topk(C).indices
    steps[2].run(want, sent1.tolist(), n1, slots, pos, rank, max(n1) + K, **how())
    idx = torch.tensor(slots, device=device)
    (ca, ta), (cb, tb), (cr, tr) = caches
    for x, y, z in ((ca.tokens, cb.tokens, cr.tokens), (ca.bonus, cb.bonus, cr.bonus),
                    (ta, tb, tr)):
        assert x[idx].cpu().tolist() == y[idx].cpu().tolist() == z[idx].cpu().tolist()
    if sampled:
        assert torch.allclose(ca.q[idx].cpu(), cr.q[idx].cpu(), atol=1e-6)
        assert torch.allclose(cb.q[idx].cpu(), cr.q[idx].cpu(), atol=1e-6)
    # the hit row's slot now holds the branch's KV at its committed positions
    assert torch.allclose(eager.cache.k[:, slots[0], :, n1[0] - 1:n1[0] - 1 + K],
                          ref.cache.k[:, slots[0], :, n1[0] - 1:n1[0] - 1 + K])
    if pool_kind in ("all", "graph-all"):  # the continuation too: every bucket
        assert {k[1] for k in steps[1].pool.keys() if k[0] == "tree_continue"} == {1, 2, 4, 8}


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_sampled_tree_build_step_equals_eager_and_stepwise(tiny_dirs, device, pool_kind):
    """The sampled build as one captured step (rows' sampling parameters and stream positions
    as static inputs; a greedy row, a top-p row, a ghost row) == the same body eagerly == one
    tree_forward + sample_branches per depth with the rows' streams; two rounds."""
    from types import SimpleNamespace

    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.sampler import sample_branches, sampling_tensors
    from ssdlib.engine.speculator.spec_cache import SpeculationCache
    from ssdlib.engine.speculator.tree_build import TreeBuildStep
    from ssdlib.sampling import SamplingParams
    from ssdlib.speculative.rng import RowStream, RowStreams

    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    V, K, C, c = ck.config.vocab_size, 3, 5, 0.5
    fan = (2, 1, 1, 0)
    B = sum(fan)
    pos = torch.tensor([0, 0, 1, 2], device=device)
    rank = torch.tensor([0, 1, 0, 0], device=device)
    g = torch.Generator().manual_seed(5)
    lens, slots = [12, 8, 10], [0, 4, 2]
    params = [SamplingParams(temperature=0.8), SamplingParams(),
              SamplingParams(temperature=1.2, top_p=0.9)]
    ids, p = pack_rows([torch.randint(0, V, (n,), generator=g).tolist() for n in lens], [0] * 3)
    for r in (eager, stepped):
        r.forward(ids, p, torch.tensor(slots), last_index(lens))

    def rows():
        return [SimpleNamespace(params=pp, stream=RowStream.from_seed(11, i))
                for i, pp in enumerate(params)]
    steps, caches, row_sets = [], [], [rows(), rows(), rows()]  # eager, stepped, reference
    for r in (eager, stepped):
        cache = SpeculationCache(7, B, K, V, r.device)
        top = torch.zeros(7, B, K, C, dtype=torch.int64, device=r.device)
        steps.append(TreeBuildStep(r, cache, top, C, V))
        caches.append(cache)
    for round_ in range(2):
        if round_ == 1:  # rows 0 and 1 swap parameters; the batch's facts (the key) stay
            for rs in row_sets:
                rs[0].params, rs[1].params = rs[1].params, rs[0].params
        cand = torch.randint(0, V, (3, K + 1, C), generator=g).to(device)
        sent = torch.randint(0, V, (3, K), generator=g)
        n = [x - K + round_ for x in lens]
        for step, rs in zip(steps, row_sets):
            step.run(cand, sent.tolist(), n, slots, pos, rank, max(lens) + K,
                     sampled_rows=rs, fan=fan, saguaro_c=c)
        ca, cb = caches
        idx = torch.tensor(slots, device=device)
        assert ca.tokens[idx].cpu().tolist() == cb.tokens[idx].cpu().tolist(), round_
        assert torch.allclose(ca.q[idx].cpu(), cb.q[idx].cpu(), atol=1e-6)
        # stepwise reference: its own streams, K * B draws a round, B per depth
        ref_rows = row_sets[2]
        streams = RowStreams.reserve([r.stream for r in ref_rows], K * B, device)
        st = sampling_tensors(ref_rows, device)
        qs = {}

        def pick(d, lg):
            tok, qs[d] = sample_branches(lg.float(), st, streams.uniforms(B, start=d * B),
                                         fan[d], c)
            return tok
        for d, tok in stepwise_tree(eager, cand, sent, n, slots, pos, rank, max(lens) + K, pick):
            assert cb.tokens[idx, :, d].cpu().tolist() == tok.cpu().tolist(), (round_, d)
            assert torch.allclose(cb.q[idx, :, d].cpu(), qs[d].cpu(), atol=1e-6)
        # the greedy row's branch tokens are argmaxes: its q is one-hot (row 1, then row 0)
        greedy_slot = slots[1] if round_ == 0 else slots[0]
        assert torch.equal(cb.q[greedy_slot].amax(-1).cpu(), torch.ones(B, K))


def test_compiled_step_is_one_graph_and_equals_eager(tiny_dirs):
    """torch.compile sees the slot-attention kernel as one opaque op (``ssdlib::slot_attention``):
    a decode step and a tree step trace with no graph break (fullgraph) and give the eager
    logits. CPU: aot_eager backend, the kernel's torch reference behind the op."""
    from ssdlib.engine.runner.compiled import compile_step_model
    from ssdlib.layers.attention import AttentionMetadata

    ck = load_checkpoint(tiny_dirs["smol_heads"])
    runner = ModelRunner(ck, None, "cpu", torch.float32, n_slots=4, max_len=64, tree_len=8)
    model = runner.model
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(3)
    cache = runner.cache
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    slots = torch.tensor([2, 0])
    ids = torch.randint(0, V, (2, 1), generator=g)
    pos = torch.tensor([[17], [9]])

    def meta(**kw):
        return AttentionMetadata(pos, slots, cache.max_len, kv_limit=pos + 1, use_kernel=True,
                                 kernel_backend="torch", **kw)

    with torch.inference_mode():
        want = model(ids, cache, meta())
        got = compiled(ids, cache, meta())
    assert (want - got).abs().max().item() <= 1e-5
    # a tree step: branches see their prefix and, through the mask, earlier branch keys
    tree_index = torch.tensor([[1], [0]])
    tree_mask = torch.tensor([[[True, True, False]], [[True, False, False]]])
    with torch.inference_mode():
        want = model(ids, cache, meta(tree_index=tree_index, tree_mask=tree_mask, tree_len=3))
        got = compiled(ids, cache, meta(tree_index=tree_index, tree_mask=tree_mask, tree_len=3))
    assert (want - got).abs().max().item() <= 1e-5


def test_compile_step_model_compiles_one_layer_for_all(tiny_dirs):
    """The engine's compile (``compile_step_model``) wraps each decoder layer: one compiled
    graph serves every layer (not one per layer), the logits equal the plain model's, and the
    plain model (the prefill graphs') keeps its uncompiled layers and shares the weights."""
    import torch._dynamo

    from ssdlib.engine.runner.compiled import compile_step_model
    from ssdlib.layers.attention import AttentionMetadata

    ck = load_checkpoint(tiny_dirs["smol_heads"])
    assert ck.config.num_hidden_layers >= 2
    runner = ModelRunner(ck, None, "cpu", torch.float32, n_slots=4, max_len=64)
    model = runner.model
    graphs, runs = [], []

    def counting(gm, example_inputs):  # a backend that counts compiles and runs
        graphs.append(gm)

        def run(*args):
            runs.append(len(graphs))
            return gm.forward(*args)
        return run
    torch._dynamo.reset()
    step = compile_step_model(model, backend=counting)
    assert all(type(layer) is type(model.model.layers[0]) for layer in model.model.layers)
    assert step.lm_head is model.lm_head and step.model.norm is model.model.norm
    assert (next(step.model.layers[1].parameters())
            is next(model.model.layers[1].parameters()))
    g = torch.Generator().manual_seed(5)
    cache = runner.cache
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    V = ck.config.vocab_size
    for b in (1, 2):  # a second batch size: one more compile (static shapes), not one per layer
        ids = torch.randint(0, V, (b, 1), generator=g)
        pos = torch.tensor([[7 + i] for i in range(b)])
        meta = AttentionMetadata(pos, torch.arange(b), cache.max_len, kv_limit=pos + 1,
                                 use_kernel=True, kernel_backend="torch")
        meta2 = AttentionMetadata(pos, torch.arange(b), cache.max_len, kv_limit=pos + 1,
                                  use_kernel=True, kernel_backend="torch")
        runs.clear()
        with torch.inference_mode():
            want = model(ids, cache, meta)
            got = step(ids, cache, meta2)
        assert (want - got).abs().max().item() <= 1e-5
        # one graph, compiled once, run by each layer
        assert len(graphs) == b and runs == [b] * ck.config.num_hidden_layers, (b, graphs, runs)
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor on CUDA")
def test_runner_compile_on_cuda_equals_eager_through_graphs(tiny_dirs):
    """compile=True on CUDA: the captured steps run the regionally compiled layers (inductor's
    kernels inside the graphs) and give the plain runner's logits (fp32)."""
    ck = load_checkpoint(tiny_dirs["smol_heads"])
    runners = [ModelRunner(ck, None, "cuda", torch.float32, n_slots=2, max_len=64,
                           cuda_graphs=True, compile=c) for c in (False, True)]
    assert runners[1].step_model is not runners[1].model
    V = ck.config.vocab_size
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(12).view(1, -1)
    outs = []
    for r in runners:
        got, n = [], 12
        r.forward(ids, pos, torch.tensor([0]), torch.tensor([[11]]))  # prefill (plain model)
        for s in (1, 4):  # a decode step and a verify-shaped step, each twice (replayed)
            for _ in range(2):
                p = n + torch.arange(s).view(1, -1)
                got.append(r.forward(ids[:, :s], p, torch.tensor([0])).float().cpu())
                n += s
        outs.append(torch.cat([g.flatten() for g in got]))
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-3 * outs[0].abs().max().item()


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_prefill_buckets_equal_eager(tiny_dirs, device, pool_kind):
    """Prefills longer than a step graph's queries run padded to a length bucket (their own
    StepGraphs, SDPA attention): the logits of each row's last token and the KV the rows leave
    behind equal the eager prefill's, from position 0 and continuing a cached prefix; decode
    steps after it agree too."""
    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.runner.model_runner import prefill_bucket
    from ssdlib.ops.graph_pool import EagerPool

    assert [prefill_bucket(s, 300) for s in (1, 128, 129, 256, 257, 400)] == \
        [128, 128, 256, 256, 300, 300]
    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    cap = stepped.cache.max_len  # 96 + slack
    pool = (EagerPool() if pool_kind == "eager" else EagerPool(warmup=2) if pool_kind == "warm"
            else stepped.graphs.pool)
    stepped.prefill_graphs = StepGraphs(stepped, pool, 6, cap, 0, kind="prefill",
                                        use_kernel=False)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(1)
    slots = torch.tensor([4, 0, 2])
    calls = []
    real = stepped._prefill_step
    stepped._prefill_step = lambda *a: calls.append(a[0].shape) or real(*a)
    # the second round's last row ends past the first length bucket (keys past 128 are read)
    for starts, lens in (([0, 0, 0], [30, 23, 31]), ([30, 23, 31], [20, 29, 98])):
        rows = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
        ids, pos = pack_rows(rows, starts)
        a = eager.forward(ids, pos, slots, last_index(lens))
        b = stepped.forward(ids, pos, slots, last_index(lens))
        assert (a - b).abs().max().item() <= 1e-4
    assert calls == [(3, 31), (3, 98)]  # both went through the prefill graphs
    for i, n in zip(slots.tolist(), (50, 52, 129)):  # the rows' KV, up to their lengths
        torch.testing.assert_close(eager.cache.k[:, i, :, :n], stepped.cache.k[:, i, :, :n],
                                   atol=1e-5, rtol=1e-5)
    new = torch.randint(0, V, (3, 1), generator=g)
    p = torch.tensor([[50], [52], [129]])
    assert (eager.forward(new, p, slots) - stepped.forward(new, p, slots)).abs().max() <= 1e-4
    # too long for any bucket past its start: eager
    ids, pos = pack_rows([[1] * 50], [cap - 40])
    assert not stepped._prefill_fits(ids, pos, last_index([50]))
    # prefill graphs capped below the cache length: longer prefills run eagerly
    stepped.prefill_graphs = StepGraphs(stepped, pool, 6, 128, 0, kind="prefill",
                                        use_kernel=False)
    for n, fits in ((100, True), (128, True), (129, False)):
        ids, pos = pack_rows([[1] * n], [0])
        assert stepped._prefill_fits(ids, pos, last_index([n])) == fits


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_single_row_prefill_graphs_go_past_the_batched_cap(tiny_dirs, monkeypatch, device,
                                                           pool_kind):
    """Past MAX_PREFILL_GRAPH positions only one row's prefill from position 0 takes a prefill
    graph (up to the graphs' longest bucket, MAX_SINGLE_PREFILL_GRAPH on CUDA): its logits and
    KV equal the eager prefill's, and the decode step after it agrees. Several rows, or one row
    continuing a cached prefix, that long run eagerly."""
    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.runner import model_runner
    from ssdlib.ops.graph_pool import EagerPool

    monkeypatch.setattr(model_runner, "MAX_PREFILL_GRAPH", 128)  # the batched cap, scaled down
    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    cap = stepped.cache.max_len
    pool = EagerPool(warmup=2) if pool_kind != "graph" else stepped.graphs.pool
    stepped.prefill_graphs = StepGraphs(stepped, pool, 6, cap, 0, kind="prefill",
                                        use_kernel=False)
    calls = []
    real = stepped._prefill_step
    stepped._prefill_step = lambda *a: calls.append(a[0].shape) or real(*a)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(3)
    row = torch.randint(0, V, (140,), generator=g).tolist()  # past the batched cap of 128
    ids, pos = pack_rows([row], [0])
    slots = torch.tensor([2])
    a = eager.forward(ids, pos, slots, last_index([140]))
    b = stepped.forward(ids, pos, slots, last_index([140]))
    assert calls == [(1, 140)] and (a - b).abs().max().item() <= 1e-4
    torch.testing.assert_close(eager.cache.k[:, 2, :, :140], stepped.cache.k[:, 2, :, :140],
                               atol=1e-5, rtol=1e-5)
    new, p = torch.randint(0, V, (1, 1), generator=g), torch.tensor([[140]])
    assert (eager.forward(new, p, slots) - stepped.forward(new, p, slots)).abs().max() <= 1e-4
    # two rows that long, or one continuing a prefix: eager; at most 128 positions: graphs
    for rows, starts, fits in (([row, row], [0, 0], False), ([row[:10]], [5], True),
                               ([row[:130]], [5], False), ([row[:100], row[:120]], [0, 0], True)):
        ids, pos = pack_rows(rows, starts)
        assert stepped._prefill_fits(ids, pos, last_index([len(r) for r in rows])) == fits


@pytest.fixture(scope="module")
def windowed_tiny(tmp_path_factory):
    """A tiny Mistral (Llama layers, a sliding window of 128): its prompts past the window take
    the masked prefill path, as the default SmolLM2 draft's do."""
    from tests.tiny import make_tiny_llama

    return make_tiny_llama(str(tmp_path_factory.mktemp("windowed_tiny")), "smol_heads",
                           sliding_window=128, max_position_embeddings=512)


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_long_prefills_run_as_chunks_of_prefill_graphs(windowed_tiny, monkeypatch, device,
                                                       pool_kind):
    """A prefill too long for one prefill graph (several rows, a windowed model's row from 0,
    a row continuing a cached prefix) runs as chunks of MAX_PREFILL_GRAPH positions, one
    prefill graph each: its logits at every index asked (indices in different chunks) and the
    KV it leaves equal the eager prefill's, and the decode step after it agrees. Positions
    that are not consecutive, or a chunk that fits no graph, keep the eager prefill."""
    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.runner import model_runner
    from ssdlib.ops.graph_pool import EagerPool, make_graph_pool

    monkeypatch.setattr(model_runner, "MAX_PREFILL_GRAPH", 128)  # the chunk, scaled down
    ck = load_checkpoint(windowed_tiny)
    eager = ModelRunner(ck, None, device, torch.float32, n_slots=4, max_len=400)
    eager.graphs = None
    stepped = ModelRunner(ck, None, device, torch.float32, n_slots=4, max_len=400)
    stepped.graphs = None
    pool = (make_graph_pool(torch.device(device), True) if device == "cuda"
            else EagerPool(warmup=2 if pool_kind != "eager" else 0))
    stepped.prefill_graphs = StepGraphs(stepped, pool, 4, 128, 0, kind="prefill",
                                        use_kernel=False)
    calls = []
    real = stepped._prefill_step
    stepped._prefill_step = lambda *a: calls.append((a[0].shape[0], a[0].shape[1])) or real(*a)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(11)
    slots = torch.tensor([3, 1])
    rows = [torch.randint(3, V, (300,), generator=g).tolist(),
            torch.randint(3, V, (250,), generator=g).tolist()]
    cases = [  # rows, starts, slots, logits index, the chunks' (rows, columns)
        ([rows[0]], [0], [3], last_index([300]), [(1, 128), (1, 128), (1, 44)]),
        (rows, [0, 0], [3, 1], torch.tensor([[299, 5], [140, 249]]),
         [(2, 128), (2, 128), (2, 44)]),
        ([rows[1][:200]], [20], [2], last_index([200]), [(1, 128), (1, 72)]),
    ]
    for case_rows, starts, case_slots, index, chunks in cases:
        calls.clear()
        ids, pos = pack_rows(case_rows, starts)
        a = eager.forward(ids, pos, torch.tensor(case_slots), index)
        got = stepped.forward(ids, pos, torch.tensor(case_slots), index)
        assert calls == chunks
        assert (a - got).abs().max().item() <= 1e-4
        for i, (r, st) in zip(case_slots, zip(case_rows, starts)):
            torch.testing.assert_close(eager.cache.k[:, i, :, :st + len(r)],
                                       stepped.cache.k[:, i, :, :st + len(r)],
                                       atol=1e-5, rtol=1e-5)
    new, p = torch.randint(3, V, (2, 1), generator=g), torch.tensor([[300], [250]])
    assert (eager.forward(new, p, slots) - stepped.forward(new, p, slots)).abs().max() <= 1e-4
    # not consecutive (a row's positions jump), or a last chunk past the cache: eager
    ids, pos = pack_rows([rows[0]], [0])
    pos[0, 200:] += 5
    assert stepped._prefill_chunks(ids, pos, last_index([300])) == []
    ids, pos = pack_rows([rows[0]], [stepped.cache.max_len - 300])
    assert stepped._prefill_chunks(ids, pos, last_index([300])) == []
    calls.clear()
    ids, pos = pack_rows([rows[0][:100]], [0])  # one graph holds it: no chunks
    stepped.forward(ids, pos, slots[:1], last_index([100]))
    assert calls == [(1, 100)]


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_prefix_chain_equals_forward_then_steps(tiny_dirs, device, pool_kind):
    """The draft's greedy proposal as one chain (the unseen tokens' forward, its argmax, then
    the greedy steps) == one forward + argmax per step, for rows catching up 1 or 2 tokens; and
    for a catch-up too long for a step graph (forward, then the chain's graph)."""
    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(5)
    lens = [10, 6, 13]
    slots = torch.tensor([5, 1, 3])
    from ssdlib.engine.batching import last_index, pack_rows

    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    ids, pos = pack_rows(prompts, [0] * 3)
    for r in (eager, stepped):
        r.forward(ids, pos, slots, last_index(lens))
    chains = []  # the one-graph chain's calls
    one = stepped.graphs.prefix_chain
    stepped.graphs.prefix_chain = lambda *a: chains.append(a[0].shape) or one(*a)
    # 1-2 unseen tokens fit a step graph (one chain); 20 do not (forward, then the chain)
    for steps, n_unseen in ((3, (1, 2, 1)), (0, (1, 2, 1)), (2, (20, 3, 1))):
        unseen = [torch.randint(0, V, (n,), generator=g).tolist() for n in n_unseen]
        ids, pos = pack_rows(unseen, lens)
        index = last_index(list(n_unseen))
        got = stepped.prefix_chain(ids, pos, slots, index, steps, V).cpu()
        tok = eager.forward(ids, pos, slots, index)[:, 0].argmax(-1)
        want = [tok.cpu()]
        after = torch.tensor([n + len(u) for n, u in zip(lens, unseen)])
        for j in range(steps):
            tok = eager.forward(tok.view(-1, 1), (after + j).view(-1, 1), slots)[:, 0].argmax(-1)
            want.append(tok.cpu())
        assert got.tolist() == torch.stack(want, 1).tolist()
        lens = [n + len(u) for n, u in zip(lens, unseen)]
    assert chains == [(3, 2), (3, 2)]  # not the 20-token catch-up


@pytest.mark.parametrize("device,pool_kind", kinds())
def test_sampled_chain_equals_forward_then_draws(tiny_dirs, device, pool_kind):
    """The draft's sampled proposal as one chain (``sampled_chain.py``: the unseen tokens'
    forward, then a draw from each row's target distribution and a forward per token) == one
    eager forward + target_distributions + draw_tokens per token with the rows' streams, for
    a temperature row, a greedy row and a top-k / top-p row; tokens equal, q equal; a
    target vocabulary larger than the draft's (padded with -inf: never drawn); and a catch-up
    too long for a step graph (forward, first draw, then the chain's graph)."""
    from types import SimpleNamespace

    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.sampled_chain import sampled_chain
    from ssdlib.engine.sampler import draw_tokens, sampling_tensors
    from ssdlib.sampling import SamplingParams, SamplingTensors, target_distributions
    from ssdlib.speculative.rng import RowStream, RowStreams

    ck, eager, stepped = runners(tiny_dirs["smol_heads"], device, pool_kind)
    Vd = ck.config.vocab_size
    V = Vd + 3  # the target's vocabulary: three tokens the draft lacks
    g = torch.Generator().manual_seed(7)
    lens = [10, 6, 13]
    slots = torch.tensor([5, 1, 3])
    params = [SamplingParams(temperature=0.8), SamplingParams(),
              SamplingParams(temperature=1.3, top_k=7, top_p=0.9)]
    rows = [SimpleNamespace(params=p, stream=RowStream.from_seed(3, i))
            for i, p in enumerate(params)]
    ref_streams = [RowStream.from_seed(3, i) for i in range(3)]
    prompts = [torch.randint(0, Vd, (n,), generator=g).tolist() for n in lens]
    ids, pos = pack_rows(prompts, [0] * 3)
    for r in (eager, stepped):
        r.forward(ids, pos, slots, last_index(lens))
    chains = []  # the one-graph chain's calls: (rows, unseen tokens)
    one = stepped.graphs.sampled_chain
    stepped.graphs.sampled_chain = lambda *a: chains.append(tuple(a[0].shape)) or one(*a)
    st = sampling_tensors(rows, device)
    for steps, n_unseen in ((3, (1, 2, 1)), (0, (1, 2, 1)), (2, (20, 3, 1))):
        k = steps + 1
        unseen = [torch.randint(0, Vd, (n,), generator=g).tolist() for n in n_unseen]
        ids, pos = pack_rows(unseen, lens)
        index = last_index(list(n_unseen))
        streams = torch.tensor([[r.stream.key, r.stream.reserve(k)] for r in rows])
        tokens, q = sampled_chain(stepped, ids, pos, slots, index, steps, V,
                                  SamplingTensors.host_table(params), streams,
                                  SamplingTensors.host_facts(params))
        # reference: step by step on the eager runner
        u = RowStreams.reserve(ref_streams, k, device).uniforms(k)
        logits = eager.forward(ids, pos, slots, index)[:, 0].float()
        after = torch.tensor([n + len(x) for n, x in zip(lens, unseen)])
        want_t, want_q = [], []
        for j in range(k):
            logits = torch.nn.functional.pad(logits, (0, V - Vd), value=float("-inf"))
            qj = target_distributions(logits, st)
            tok = draw_tokens(qj, logits, st, u[:, j])
            want_t.append(tok.cpu())
            want_q.append(qj.cpu())
            if j < steps:
                logits = eager.forward(tok.view(-1, 1), (after + j).view(-1, 1),
                                       slots)[:, 0].float()
        assert tokens.cpu().tolist() == torch.stack(want_t, 1).tolist()
        assert torch.allclose(q.cpu(), torch.stack(want_q, 1), atol=1e-6)
        assert q.shape == (3, k, V) and float(q[..., Vd:].abs().max()) == 0.0
        assert torch.equal(q[1].amax(-1).cpu(), torch.ones(k))  # the greedy row: one-hot
        lens = [n + len(x) for n, x in zip(lens, unseen)]
    # the 20-token catch-up: its first draw after the forward, its last 2 in the chain
    assert chains == [(3, 2), (3, 2), (3, 1)]


def test_a_step_graphs_model_is_the_runners_step_model_unless_given(tiny_dirs):
    """Forward steps run the runner's step model (torch.compile'd with compile=True); the
    prefill graphs are given the plain model, so compile does not compile every prefill
    length bucket at start-up."""
    from ssdlib.ops.graph_pool import EagerPool

    ck = load_checkpoint(tiny_dirs["smol_heads"])
    r = ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64)
    calls = []

    def step_model(*args):
        calls.append("step")
        return r.model(*args)

    def plain(*args):
        calls.append("plain")
        return r.model(*args)
    r.step_model = step_model
    ids, pos, slots = torch.tensor([[5, 6]]), torch.tensor([[0, 1]]), torch.tensor([0])
    for model, want in ((None, "step"), (plain, "plain")):
        calls.clear()
        g = StepGraphs(r, EagerPool(), 2, 16, 0, kind="prefill", model=model)
        with torch.inference_mode():
            out = g.forward(ids, pos, slots, pos + 1, None, 64)
        assert calls == [want] and out.shape == (1, 2, ck.config.vocab_size)


def test_compile_default_is_on_for_captured_unsharded_cuda_steps():
    from ssdlib.engine.runner.compiled import wants_compile

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert wants_compile(None, cuda, True, 1, triton=True)
    assert not wants_compile(None, cuda, True, 1, triton=False)  # inductor needs triton
    assert not wants_compile(None, cuda, False, 1, triton=True)  # --no-cuda-graphs: eager
    assert not wants_compile(None, cuda, True, 2, triton=True)  # TP > 1 only when asked
    assert wants_compile(True, cuda, True, 2) and not wants_compile(False, cuda, True, 1)
    assert not any(wants_compile(c, cpu, True, 1, triton=True) for c in (None, True, False))


@pytest.mark.parametrize("pool_kind", ["all", "warm"])
def test_compiled_steps_pad_long_indexed_forwards_to_a_power_of_two(tiny_dirs, pool_kind):
    """Compiled steps (all buckets): a forward of more than EXACT_STEP_QUERIES queries with a
    logits index (a short prompt) runs padded to a power of two, so prompt lengths 9..16 share
    one shape; the logits, the draft chain's tokens and the rows' KV at their real positions
    equal the eager runner's. Uncompiled steps keep the exact length."""
    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.runner.model_runner import EXACT_STEP_QUERIES

    ck, eager, stepped = runners(tiny_dirs["smol_heads"], "cpu", pool_kind)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(8)
    slots = torch.tensor([2, 0])
    lens = [11, EXACT_STEP_QUERIES + 1]
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in lens]
    ids, pos = pack_rows(prompts, [0, 0])
    a = eager.forward(ids, pos, slots, last_index(lens))
    b = stepped.forward(ids, pos, slots, last_index(lens))
    assert (a - b).abs().max().item() <= 1e-4
    for i, n in zip(slots.tolist(), lens):
        assert torch.allclose(eager.cache.k[:, i, :, :n], stepped.cache.k[:, i, :, :n], atol=1e-5)
    # the draft's catch-up over 13 unseen tokens, then 2 greedy steps, in one chain
    unseen = [torch.randint(0, V, (13,), generator=g).tolist() for _ in lens]
    ids, pos = pack_rows(unseen, lens)
    index = last_index([13, 13])
    got = stepped.prefix_chain(ids, pos, slots, index, 2, V).cpu()
    want = eager.prefix_chain(ids, pos, slots, index, 2, V).cpu()
    assert got.tolist() == want.tolist()
    sizes = {k[2] for k in stepped.graphs.pool.keys() if k[0] in ("fwd", "pchain")}
    assert sizes == ({16} if pool_kind == "all" else {11, 13})


def test_a_failing_compile_falls_back_to_the_plain_model_with_a_warning(tiny_dirs, caplog):
    import logging

    import torch._dynamo

    from ssdlib.engine.runner.compiled import checked_step_model

    ck = load_checkpoint(tiny_dirs["smol_heads"])
    r = ModelRunner(ck, None, "cpu", torch.float32, n_slots=2, max_len=64)

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")
    torch._dynamo.reset()
    with caplog.at_level(logging.WARNING):
        got = checked_step_model(r.model, r.cache, r.scratch_slot, r.use_kernel,
                                 backend=broken)
    assert got is r.model
    assert "torch.compile of the decoder layers failed" in caplog.text
    assert "no compiler here" in caplog.text
    torch._dynamo.reset()
    ok = checked_step_model(r.model, r.cache, r.scratch_slot, r.use_kernel, backend="eager")
    assert ok is not r.model and ok.lm_head is r.model.lm_head
    torch._dynamo.reset()


def test_a_feature_draft_compiles_its_layers_or_runs_plain(tiny_dirs, tmp_path, caplog,
                                                             monkeypatch):
    """``checked_feature_step_draft``: a feature draft whose layers compile is a view sharing
    every other module (the draft keeps its plain layers); where compiling fails, the plain
    draft and a warning naming the error. ``feature_compile_backend``: inductor only with
    ``SSDLIB_FEATURE_COMPILE`` on, where a draft runner's steps would compile."""
    import logging

    import torch._dynamo

    from ssdlib.engine.runner.compiled import (checked_feature_step_draft,
                                               feature_compile_backend)
    from ssdlib.engine.speculator.feature_spec_draft import FeatureSpecDraft
    from ssdlib.loading.feature_draft import load_feature_draft
    from ssdlib.models.llama import LlamaDecoderLayer
    from tests.engine.test_feature_draft_sd import _feature_draft
    from tests.feature_helpers import frozen_target

    ck, target = frozen_target(tiny_dirs["smol_heads"])
    draft = load_feature_draft(_feature_draft(tiny_dirs["smol_heads"], tmp_path / "fd"), ck,
                               target, "cpu", torch.float32)
    plain = FeatureSpecDraft(draft, 3, 64, ck.config.vocab_size, 8, "cpu", torch.float32)

    def broken(gm, example_inputs):
        raise RuntimeError("no compiler here")
    torch._dynamo.reset()
    try:
        with caplog.at_level(logging.WARNING):
            got = checked_feature_step_draft(draft, plain.cache, plain.scratch_slot, False,
                                             backend=broken)
        assert got is draft
        assert "torch.compile of the decoder layers failed" in caplog.text
        assert "no compiler here" in caplog.text
        torch._dynamo.reset()
        ok = checked_feature_step_draft(draft, plain.cache, plain.scratch_slot, False,
                                        backend="eager")
        assert ok is not draft and ok.fc is draft.fc and ok.norm is draft.norm
        assert all(type(m) is LlamaDecoderLayer for m in draft.layers)
        assert not any(type(m) is LlamaDecoderLayer for m in ok.layers)
    finally:
        torch._dynamo.reset()
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv("SSDLIB_FEATURE_COMPILE", raising=False)
    assert feature_compile_backend(True, cuda, True) is None  # off unless asked
    monkeypatch.setenv("SSDLIB_FEATURE_COMPILE", "1")
    assert feature_compile_backend(True, cuda, True) == "inductor"
    assert feature_compile_backend(False, cuda, True) is None  # --no-compile
    assert feature_compile_backend(True, cpu, True) is None


def test_step_queries_pads_only_consecutive_positions(tiny_dirs):
    ck, _, stepped = runners(tiny_dirs["smol_heads"], "cpu", "all")
    ids = torch.arange(22).view(2, 11)
    pos = torch.tensor([[3], [7]]) + torch.arange(11)
    index = torch.tensor([[10], [10]])
    got_ids, got_pos = stepped.step_queries(ids, pos, index)
    assert got_ids.shape == (2, 16) and torch.equal(got_ids[:, :11], ids)
    assert torch.equal(got_pos, torch.tensor([[3], [7]]) + torch.arange(16))
    gappy = pos.clone()
    gappy[0, 5:] += 2  # not one run of positions: left as it is
    assert stepped.step_queries(ids, gappy, index)[1] is gappy
    assert stepped.step_queries(ids, pos, None)[1] is pos  # no logits index: all positions
    short = torch.tensor([[3], [7]]) + torch.arange(8)
    assert stepped.step_queries(ids[:, :8], short, index)[1] is short  # up to 8: exact


@pytest.mark.parametrize("pool_kind", ["all", "warm"])
def test_catch_up_of_one_token_takes_the_two_token_step(tiny_dirs, pool_kind):
    """On the capture-every-bucket policy a draft's catch-up of 1 unseen token is padded to 2,
    so rounds that accepted every draft (2 unseen) find the step a warm-up captured whatever its
    rounds accepted; the proposal is unchanged. Without that policy the length stays exact."""
    from ssdlib.engine.batching import last_index, pack_rows
    from ssdlib.engine.runner.model_runner import CATCH_UP_QUERIES

    ck, eager, stepped = runners(tiny_dirs["smol_heads"], "cpu", pool_kind)
    V = ck.config.vocab_size
    g = torch.Generator().manual_seed(3)
    slots, lens = torch.tensor([1, 4]), [7, 9]
    ids, pos = pack_rows([torch.randint(0, V, (n,), generator=g).tolist() for n in lens], [0, 0])
    for r in (eager, stepped):
        r.forward(ids, pos, slots, last_index(lens))
    unseen = [torch.randint(0, V, (1,), generator=g).tolist() for _ in lens]
    ids, pos = pack_rows(unseen, lens)
    got = stepped.prefix_chain(ids, pos, slots, last_index([1, 1]), 3, V).cpu()
    want = eager.prefix_chain(ids, pos, slots, last_index([1, 1]), 3, V).cpu()
    assert got.tolist() == want.tolist()
    widths = {k[2] for k in stepped.graphs.pool.keys() if k[0] == "pchain"}
    assert widths == ({CATCH_UP_QUERIES} if pool_kind == "all" else {1})


def test_compile_dynamic_batch_compiles_once_for_every_batch_above_one(tiny_dirs, monkeypatch):
    """By default (SSDLIB_COMPILE_DYNAMIC=1) one compile serves batches 2, 3, 4 and 5 (with 0:
    one each), a batch of one its own, and the logits equal the plain model's."""
    import torch._dynamo

    from ssdlib.engine.runner.compiled import compile_step_model
    from ssdlib.layers.attention import AttentionMetadata

    ck = load_checkpoint(tiny_dirs["smol_heads"])
    runner = ModelRunner(ck, None, "cpu", torch.float32, n_slots=6, max_len=64)
    model, cache = runner.model, runner.cache
    g = torch.Generator().manual_seed(6)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)

    def compiles(dynamic: bool) -> int:
        graphs = []

        def counting(gm, example_inputs):
            graphs.append(gm)
            return gm.forward
        if dynamic:
            monkeypatch.delenv("SSDLIB_COMPILE_DYNAMIC", raising=False)  # the default
        else:
            monkeypatch.setenv("SSDLIB_COMPILE_DYNAMIC", "0")
        torch._dynamo.reset()
        step = compile_step_model(model, backend=counting)
        assert step.kv_heads_local == model.kv_heads_local  # the layers' attributes reach through
        for b in (1, 2, 3, 4, 5):
            ids = torch.randint(0, ck.config.vocab_size, (b, 1), generator=g)
            pos = torch.tensor([[9 + i] for i in range(b)])

            def meta():
                return AttentionMetadata(pos, torch.arange(b), cache.max_len, kv_limit=pos + 1,
                                         use_kernel=True, kernel_backend="torch")
            with torch.inference_mode():
                want, got = model(ids, cache, meta()), step(ids, cache, meta())
            assert (want - got).abs().max().item() <= 1e-5
        torch._dynamo.reset()
        return len(graphs)

    assert compiles(dynamic=False) == 5
    assert compiles(dynamic=True) == 2
