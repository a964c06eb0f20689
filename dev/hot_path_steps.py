"""The engine's hot-path steps, each as a call with the real models' shapes, on any device.

Shared by ``dev/op_count.py`` (counts each step's device ops, CPU is enough) and
``dev/step_times.py`` (times each step on a GPU, eagerly and as one graph replay, and lists
a step's kernels). A step is what one role runs once a round: the target's verify forward
(K + 1 queries a row; again with a feature draft's features kept, as the engine's target does
beside one) and the acceptance after it, SD's proposal and verify round as the leader
runs them (host inputs packed and copied, the captured steps replayed, the outcome read back;
also with features kept, and with ``feature_draft`` SD's proposal with that draft), the
draft's decode step, SD's draft chain
(greedy and sampled), the speculator's cache build (greedy / sampled; fresh rows and rows that
continue a hit; with ``feature_draft`` also that draft's commit of a round's features, its
build's teacher-forced chain and tree depths apart, and its whole build), the speculator's
whole round as its rank runs it (``speculator_rounds.py``:
OUTCOME in, answer, build, CACHE read on the leader's host; greedy and T = 0.7) and the sampled
build's per-depth draw alone.

On CPU the runners have no graph pool and the attention op runs its torch reference (one op a
layer); on CUDA they are the engine's own runners with its graph pool, so a cache build runs as
the speculator runs it (host preparation, one copy, its captured steps' replays).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Callable

import torch

SAMPLED = {"temperature": 0.7}  # the sampled steps' parameters


@dataclass
class Step:
    fn: Callable[[], object]
    capturable: bool  # pure device work on static inputs: can be captured as one graph
    details: Callable[[], dict] | None = None  # more readings after the calls (e.g. phases)


@contextlib.contextmanager
def torch_attention_backend():
    """Inside: the slot-attention op runs its torch reference (the steps ask for Triton, which
    a CPU lacks); restored after."""
    from ssdlib.layers import attention

    plain = attention.slot_attention  # the name the attention layer calls

    def on_cpu(*args, backend="triton", **kwargs):
        return plain(*args, backend="torch", **kwargs)
    attention.slot_attention = on_cpu
    try:
        yield
    finally:
        attention.slot_attention = plain


def add_step_args(ap) -> None:
    """The arguments that choose the steps' shapes (``hot_path_steps``'s), for the tools that
    use them."""
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="smollm2-135m-draft")
    ap.add_argument("--feature-draft", default=None, metavar="DIR",
                    help="also time SD's proposal with this feature draft (e.g. "
                         "smollm2-135m-eagle), the verify keeping its features and SSD's "
                         "commit and build with it")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--fan-out-budget", type=int, default=16)
    ap.add_argument("--batch", type=int, default=1)


def _runner(ck, device, dtype, n_slots: int, tree_len: int, features=False):
    from ssdlib.engine.runner.model_runner import ModelRunner

    r = ModelRunner(ck, None, device, dtype, n_slots=n_slots, max_len=256, tree_len=tree_len,
                    cuda_graphs=torch.device(device).type == "cuda", features=features)
    r.use_kernel = True  # the hot path's attention: one slot-attention op a layer
    return r


def _feature_draft(directory: str, tck, ftr, dev, dtype):
    """The feature draft in ``directory`` beside the target runner ``ftr`` (its embedding and
    head shared, RoPE as long as its cache) and the torch.compile backend of its steps as the
    engine would choose it (``SSDLIB_FEATURE_COMPILE`` on a GPU)."""
    from ssdlib.engine.runner.compiled import feature_compile_backend
    from ssdlib.loading.feature_draft import load_feature_draft

    draft = load_feature_draft(directory, tck, ftr.model, dev, dtype,
                               max_positions=ftr.cache.max_len)
    return draft, feature_compile_backend(None, dev, True)


def _feature_proposal(draft, backend, tck, ftr, rows, b: int, K: int, dev):
    """SD's proposal with the feature ``draft`` (its steps compiled with ``backend``, None:
    plain) as the engine makes it (``FeatureDrafter``, its captured steps on CUDA), reading the
    features ``ftr`` keeps: each call feeds two unseen positions, as after a round with one
    token accepted."""
    from ssdlib.engine.feature_drafter import FeatureDrafter
    from ssdlib.ops.graph_pool import make_graph_pool

    pool = make_graph_pool(dev, enabled=True) if dev.type == "cuda" else None
    drafter = FeatureDrafter(draft, ftr.cache.features, b + 1, ftr.cache.max_len,
                             tck.config.vocab_size, draws=K, pool=pool, use_kernel=True,
                             compile_backend=backend)

    def propose():
        for r in rows:
            drafter.valid[r.slot] = len(r.tokens) - 3
        return drafter.propose(rows, K, want_q=False)[0]
    return propose


def _feature_speculator_steps(draft, backend, tck, ftr, b: int, K: int, fan: tuple, dev,
                              dtype) -> dict:
    """The steps of SSD's speculator with the feature ``draft`` (as in
    :func:`_feature_proposal`): the commit of a round's K + 1 kept positions with the target's
    features, the build's two parts on device tensors (the teacher-forced chain, one forward
    over the speculation's K positions; the K tree depths over the fan-out's rows) and the
    whole greedy build as the speculator runs it (its captured step on CUDA). Rows have 40
    committed tokens, their features fed."""
    from ssdlib.engine.speculator.feature_build import JIT, FeatureCacheBuilder
    from ssdlib.engine.speculator.feature_spec_draft import FeatureSpecDraft
    from ssdlib.engine.speculator.spec_cache import SpeculationCache
    from ssdlib.ops.graph_pool import make_graph_pool

    V, B, L = tck.config.vocab_size, sum(fan), 40
    max_len = ftr.cache.max_len
    pool = make_graph_pool(dev, enabled=True) if dev.type == "cuda" else None
    drafter = FeatureSpecDraft(draft, b + 1, max_len, V, B * K, dev, dtype, draws=K,
                               use_kernel=True, pool=pool, compile_backend=backend)
    builder = FeatureCacheBuilder(drafter, SpeculationCache(b + 1, B, K, V, dev), V, 1.0,
                                  pool=pool)
    sent = torch.randint(0, V, (b, K))
    rows = [SimpleNamespace(tokens=list(range(1, L + 1)), slot=i, sent=sent[i].tolist(),
                            fed=False, params=None, reuse=None, is_jit=True, limit=None)
            for i in range(b)]  # jit drafts: the features their steps left
    for r in rows:
        drafter.fed[r.slot] = L - 1
    slots = torch.arange(b, device=dev)
    first = torch.full((b,), L - 1, device=dev)
    sent = sent.to(dev)
    positions = (L - 1 - K + torch.arange(K + 1, device=dev)).expand(b, K + 1).contiguous()
    ids = torch.randint(0, V, (b, K + 1), device=dev)
    feats = torch.randn(b, K + 1, draft.feature_width, device=dev, dtype=dtype)
    index = torch.full((b, 1), K, device=dev)
    pos, rank = builder.branch_index(fan)
    src = torch.full((b,), JIT, device=dev)
    parts = {}

    def chain():
        pairs = builder.sent_features(slots, src, builder.cache)  # (not the commit's feats)
        parts["chain"] = builder.chain(slots, first, sent, pairs, max_len)
        return parts["chain"][1]

    def tree():
        cand, H = parts["chain"]
        builder.tree(slots, first, sent, cand, H, pos, rank, max_len)
        return builder.cache.tokens
    return {
        f"speculator feature commit ({K + 1} positions)": Step(lambda: drafter.commit_body(
            ids, positions, slots, index, feats, max_len, True), True),
        f"speculator feature build: chain ({K} positions, one forward)": Step(chain, True),
        f"speculator feature build: tree ({K} depths, {B} rows)": Step(tree, True),
        "speculator feature build, greedy, engine path": Step(
            lambda: builder.build(rows, list(fan), False), False),
    }


def _rows(b: int, params):
    from ssdlib.speculative.rng import RowStream

    return [SimpleNamespace(params=params, stream=RowStream.from_seed(7, i)) for i in range(b)]


def hot_path_steps(target: str, draft: str, b: int, K: int, budget: int,
                   device: str = "cpu", dtype: torch.dtype = torch.float32,
                   feature_draft: str | None = None):
    """({step name: Step} in the engine's order, meta). The steps hold their runners and
    inputs; call them in order (the acceptance reads the verify forward's logits).
    ``feature_draft``: the target's features are kept as that draft reads them, and SD's
    proposal with it is a step too (else fused features, no such proposal)."""
    from ssdlib.engine.speculator.cache_builder import CacheBuilder
    from ssdlib.engine.sampled_chain import sampled_chain_body
    from ssdlib.engine.sampler import row_distributions, reserve_streams, sample_branches
    from ssdlib.engine.sampler import sampling_tensors
    from ssdlib.engine.speculator.spec_cache import SpeculationCache
    from ssdlib.engine.speculator.tree_build import TreeBuildStep
    from ssdlib.layers.attention import AttentionMetadata
    from ssdlib.loading import load_checkpoint
    from ssdlib.loading.draft import load_draft
    from ssdlib.sampling import SamplingParams, SamplingTensors
    from ssdlib.speculative.acceptance import DraftQ, verify_greedy, verify_sampled
    from ssdlib.speculative.fanout import geometric_fanout

    dev = torch.device(device)
    steps: dict[str, Step] = {}
    hot = SamplingParams(**SAMPLED)
    # -- the target: verify forward, then the acceptance -------------------------------------
    tck = load_checkpoint(target)
    V = tck.config.vocab_size
    tr = _runner(tck, dev, dtype, b, 0)
    pos = torch.arange(40, 40 + K + 1, device=dev).expand(b, K + 1).contiguous()
    slots = torch.arange(b, device=dev)
    meta = AttentionMetadata(pos, slots, tr.cache.max_len, kv_limit=pos + 1, use_kernel=True)
    ids = torch.randint(0, V, (b, K + 1), device=dev)
    out = {}

    def verify_fwd():
        out["logits"] = tr.step_model(ids, tr.cache, meta)
        return out["logits"]
    steps["target verify forward"] = Step(verify_fwd, True)
    # the same forward where a feature draft reads the target: it also keeps the features of
    # the fed positions (fused: three layers' outputs; last_prenorm below 4 layers)
    from ssdlib.loading.feature_draft import feature_spec_for
    from ssdlib.models.feature_spec import FeatureSpec

    n_layers = tck.config.num_hidden_layers
    spec = feature_spec_for(feature_draft, tck) if feature_draft else \
        FeatureSpec.fused(n_layers) if n_layers >= 4 else FeatureSpec()
    ftr = _runner(tck, dev, dtype, b, 0, features=spec)
    steps[f"target verify forward, {spec.kind} features kept"] = Step(
        lambda: ftr.step_model(ids, ftr.cache, meta), True)
    drafts = ids[:, 1:]
    steps["acceptance, greedy"] = Step(lambda: verify_greedy(drafts, out["logits"]), True)
    q = torch.softmax(torch.randn(b, K, V, device=dev), -1)

    def sampled():
        rows = _rows(b, hot)
        p = row_distributions(out["logits"], rows)
        return verify_sampled(drafts, DraftQ.per_row([0] * b, q), p,
                              generators=reserve_streams(rows, K + 1, dev))
    steps["acceptance, sampled (T=0.7)"] = Step(sampled, False)  # host tables each call
    dck = load_draft(draft, tck)  # a draft reading the target's embedding gets it folded in
    # -- SD's round as the leader runs it: host inputs packed, copied, replayed, read back -----
    from ssdlib.engine.drafter import Drafter
    from ssdlib.engine.leader.verify import read_round, verify_round

    greedy_rows = [SimpleNamespace(tokens=list(range(1, 41)), slot=i, params=SamplingParams())
                   for i in range(b)]
    sd_draft = _runner(dck, dev, dtype, b, 0)
    drafter = Drafter(sd_draft, V)
    proposed = {}

    def propose():
        for r in greedy_rows:  # two unseen tokens a row, as after a round with one accepted
            drafter.valid[r.slot] = len(r.tokens) - 2
        proposed["tokens"], _ = drafter.propose(greedy_rows, K, want_q=False)
        return proposed["tokens"]
    steps[f"SD draft proposal, engine path ({K} tokens)"] = Step(propose, False)
    if feature_draft:  # loaded once, for SD's proposal and SSD's speculator below
        fdraft, fbackend = _feature_draft(feature_draft, tck, ftr, dev, dtype)
        f_propose = _feature_proposal(fdraft, fbackend, tck, ftr, greedy_rows, b, K, dev)
        steps[f"SD feature draft proposal, engine path ({K} tokens)"] = Step(f_propose, False)
    steps["SD verify round, engine path (greedy, read back)"] = Step(
        lambda: read_round(proposed["tokens"], verify_round(tr, greedy_rows, proposed["tokens"],
                                                            None, dev)), False)
    steps[f"SD verify round, engine path, {spec.kind} features kept"] = Step(
        lambda: read_round(proposed["tokens"], verify_round(ftr, greedy_rows, proposed["tokens"],
                                                            None, dev)), False)
    # -- the draft: decode step, SD's chain, the speculator's build ---------------------------
    fan = tuple(geometric_fanout(budget, K, 0.7, 1.0))
    B = sum(fan)
    dr = _runner(dck, dev, dtype, b, B * K)
    dpos = torch.full((b, 1), 40, device=dev)
    dmeta = AttentionMetadata(dpos, slots, dr.cache.max_len, kv_limit=dpos + 1, use_kernel=True)
    one = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    steps["draft decode step"] = Step(lambda: dr.step_model(one, dr.cache, dmeta), True)
    first, at = torch.zeros(b, dtype=torch.int64, device=dev), torch.full((b,), 40, device=dev)
    steps[f"SD draft chain ({K} steps)"] = Step(lambda: dr.chain_body(
        first, at, slots, K, V, dr.cache.max_len, True), True)
    hot_rows = [hot] * b
    table = SamplingTensors.host_table(hot_rows).to(dev)
    streams = torch.tensor([[1, 0]] * b, dtype=torch.int64, device=dev)
    facts = SamplingTensors.host_facts(hot_rows)
    steps[f"SD draft chain, sampled ({K} steps)"] = Step(lambda: sampled_chain_body(
        dr, one, dpos, slots, torch.zeros_like(one), K - 1, V, dr.cache.max_len, True, table,
        streams, facts), True)
    C = min(B + 1, V)
    cache = SpeculationCache(b + 1, B, K, V, dev)
    top = torch.zeros(b + 1, B, K, C, dtype=torch.int64, device=dev)
    build = TreeBuildStep(dr, cache, top, C, V)
    index = CacheBuilder.branch_index(SimpleNamespace(_index_cache={}, V=V, K=K, device=dev),
                                       fan)
    cand = torch.randint(0, V, (b, K + 1, C), device=dev)
    sent = torch.randint(0, V, (b, K)).tolist()
    lengths, live = [40] * b, list(range(b))
    for label, reuse, rows in (("greedy", None, None), ("greedy, hit rows", [0] * b, None),
                               ("sampled", None, _rows(b, hot)),
                               ("sampled, hit rows", [0] * b, _rows(b, hot))):
        # the speculator's path: host preparation, one copy, its captured steps on a GPU
        steps[f"speculator build, {label}"] = Step(
            lambda reuse=reuse, rows=rows: build.run(cand, sent, lengths, live, *index, 48,
                                                     reuse, rows, fan, 1.0), False)
    if feature_draft:
        steps.update(_feature_speculator_steps(fdraft, fbackend, tck, ftr, b, K, fan, dev,
                                               dtype))
    # -- the speculator's whole round, OUTCOME to CACHE, driven in process -------------------
    from dev.speculator_rounds import SpeculatorRounds

    for label, params in (("greedy", SamplingParams()), ("T=0.7", hot)):
        rounds = SpeculatorRounds(dck, V, dev, dtype, b, K, budget, params)
        steps[f"speculator round, engine path ({label}, 70% hits)"] = Step(
            rounds.round, False, details=rounds.phases_ms)
    blog = torch.randn(b, B, V, device=dev)
    st = sampling_tensors(_rows(b, hot), dev)
    u = torch.rand(b, B, dtype=torch.float64, device=dev)
    steps["sampled build's draw, one depth"] = Step(
        lambda: sample_branches(blog, st, u, fan[0], 1.0), True)
    meta_out = {"target": target, "draft": draft, "batch": b, "k": K, "fan_out": list(fan),
                "vocab": V, "target_layers": tck.config.num_hidden_layers,
                "draft_layers": dck.config.num_hidden_layers, "device": str(dev),
                "dtype": str(dtype).replace("torch.", "")}
    return steps, meta_out
