"""Offline greedy acceptance of a feature draft (``ssdlib.models.feature_draft``) on held-out
token sequences, with the target's features and self-conditioned.

At sampled positions p of held-out documents the committed prefix is x_0..x_p. The draft drafts
K tokens greedily from it (y_1 at p+1, ..., y_K at p+K: position i reads the token x_{i+1}, or
y_{i+1-p} past the prefix, and a feature), and the target checks them greedily on
x_0..x_p, y_1..y_K: y_i is tried only if y_1..y_{i-1} were accepted and accepted when it is the
target's argmax; drafting a round stops at the first mismatch. Reported per view: a_p =
accepted / tried, and the mean accepted length (accepted draft tokens per position, of K).

Views of the same positions:
- "true features": the target's features f_i of every committed position i < p (the SD view:
  after a verify the target has run over all but the newest token), conditioned by the draft
  (``FeatureDraft.condition``: a fused draft's ``fuse`` over the target's three layers);
- "self-conditioned": the features of the last ``m`` of them (default K + 1: the positions an SSD
  speculator drafts past while the target is still verifying them) are the draft's own, h_{i-1}
  at position i, computed autoregressively from the earlier true feature f_{p-m-1}; one view
  per ``m`` asked for.
Past the prefix (the tokens it drafts) the draft reads its own features in every view.

    python -m tools.distill.feature_eval --draft DIR --target T --data-from data.safetensors \
        [--k 5] [--positions 64] [--self-conditioned M[,M...]]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Sequence

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from ssdlib.engine_config import draft_vocab_value  # noqa: E402
from ssdlib.engine.runner.kv_cache import KVCache  # noqa: E402
from ssdlib.layers.attention import AttentionMetadata  # noqa: E402
from ssdlib.models.feature_draft import FeatureDraft  # noqa: E402
from ssdlib.ops.tree_mask import tree_mask_full  # noqa: E402
from tools.distill.data import Docs  # noqa: E402
from tools.distill.feature_train import teacher_outputs  # noqa: E402

VERIFY_ROWS = 8  # target rows verified in one forward (their logits span the vocabulary)


def sample_points(docs: Docs, n: int, k: int, m: int, max_len: int,
                  seed: int) -> dict[int, list[int]]:
    """Up to ``n`` positions p, drawn at random (seeded) over all documents: document -> sorted
    positions. A position needs p - m >= 1 (a true feature before the self-conditioned ones),
    y_1 in the target's own output (p + 1 >= score_from) and room for K drafts (p + K < max_len).
    """
    candidates = [(d, p) for d, ids in enumerate(docs.ids)
                  for p in range(max(m + 1, docs.score_from[d] - 1), min(len(ids), max_len - k))]
    chosen = random.Random(seed).sample(candidates, min(n, len(candidates)))
    points: dict[int, list[int]] = {}
    for d, p in sorted(chosen):
        points.setdefault(d, []).append(p)
    return points


@torch.no_grad()
def draft_greedy(draft: FeatureDraft, ids: torch.Tensor, features: torch.Tensor,
                 points: list[int], k: int, m: int) -> torch.Tensor:
    """K greedy draft tokens [n, K] after each prefix ids[:p+1] (p in ``points``), the target's
    ``features`` [>= max p, W] (the draft's ``feature_width``) read at positions < p - m and the
    draft's own from there on.

    Each row is prefilled over its true-feature positions into its own KV slot, then all rows
    step together, one position a step (the same number of steps for every row)."""
    device, n = ids.device, len(points)
    dtype = next(draft.parameters()).dtype
    cfg = draft.config
    cache = KVCache(cfg.num_hidden_layers, n, draft.kv_heads_local, max(points) + k,
                    cfg.head_dim, dtype, device)
    logits, hidden = [], []
    for row, p in enumerate(points):  # positions 0..p-m-1: the target's features
        start = p - m
        pos = torch.arange(start, device=device).view(1, -1)
        meta = AttentionMetadata.build(pos, torch.tensor([row], device=device), start)
        feats = draft.condition(features[:start].unsqueeze(0).to(dtype))
        out = draft(ids[1:start + 1].view(1, -1), feats, cache, meta,
                    torch.tensor([[start - 1]], device=device))
        logits.append(out[0][:, 0])
        hidden.append(out[1][:, 0])
    logits, hidden = torch.cat(logits), torch.cat(hidden)  # [n, V], [n, H]
    p = torch.tensor(points, device=device)
    slots = torch.arange(n, device=device)
    drafted = []
    # r: the last position run, relative to p - 1 (where y_1 is predicted)
    for r in range(-m, k):
        if r >= 0:
            drafted.append(logits.argmax(-1))
        if r == k - 1:
            break
        token = ids[p + r + 1] if r + 1 <= 0 else drafted[r]  # x_{i+1} or y_{i+1-p}, i = p+r
        meta = AttentionMetadata.build((p + r).view(-1, 1), slots, max(points) + r + 1)
        out = draft(token.view(-1, 1), hidden.view(n, 1, -1), cache, meta)
        logits, hidden = out[0][:, 0], out[1][:, 0]
    return torch.stack(drafted, dim=1)


@torch.no_grad()
def accepted_lengths(target, ids: torch.Tensor, points: list[int], drafted: torch.Tensor,
                     prefix: "TargetPrefix | None" = None) -> list[int]:
    """Per row: how many of its drafted tokens the target accepts greedily (the leading ones
    equal to its argmax on x_0..x_p, y_1..y_{i-1}). A target with a KV cache (a
    ``LlamaForCausalLM``) reads the prefix once (``prefix``, or a new :class:`TargetPrefix`) and
    verifies every row's drafts as branches of one tree forward; any other model takes the
    plain reference (:func:`accepted_lengths_full`)."""
    if prefix is None:
        if not hasattr(target, "kv_heads_local"):
            return accepted_lengths_full(target, ids, points, drafted)
        prefix = TargetPrefix(target, ids[:max(points) + 1])
    top = prefix.greedy(points, drafted)
    return [int((top[j] == drafted[j]).int().cumprod(0).sum()) for j in range(len(points))]


@torch.no_grad()
def accepted_lengths_full(target, ids: torch.Tensor, points: list[int],
                          drafted: torch.Tensor) -> list[int]:
    """:func:`accepted_lengths` by cache-free forwards of whole rows (``VERIFY_ROWS`` at a
    time, each as long as its prefix): the reference, for any model with
    ``forward_full_features``."""
    k = drafted.shape[1]
    out = []
    for at in range(0, len(points), VERIFY_ROWS):
        chunk = points[at:at + VERIFY_ROWS]
        rows = torch.zeros(len(chunk), max(chunk) + 1 + k, dtype=torch.long, device=ids.device)
        for j, p in enumerate(chunk):  # right-padded: causal, so padding changes nothing
            rows[j, :p + 1] = ids[:p + 1]
            rows[j, p + 1:p + 1 + k] = drafted[at + j]
        logits = target.forward_full_features(rows)[0]
        for j, p in enumerate(chunk):
            match = (logits[j, p:p + k].argmax(-1) == drafted[at + j]).int()
            out.append(int(match.cumprod(0).sum()))
    return out


class TargetPrefix:
    """One forward of the target over a document's prefix ``ids`` into a KV slot: its output at
    every position (normed; the head runs where :meth:`greedy` asks) and the features of
    ``layers`` (the outputs before any norm, concatenated: what a feature draft reads; None: the
    last layer's). Then :meth:`greedy` verifies drafts after any of its positions as branches
    of a tree forward that reads the slot, so one prefix serves many positions and views."""

    @torch.no_grad()
    def __init__(self, target, ids: torch.Tensor, layers=None) -> None:
        cfg, device = target.config, ids.device
        dtype = next(target.parameters()).dtype
        layers = (cfg.num_hidden_layers - 1,) if layers is None else tuple(layers)
        self.target, self.length = target, len(ids)
        self.cache = KVCache(cfg.num_hidden_layers, 1, target.kv_heads_local, self.length,
                             cfg.head_dim, dtype, device,
                             features_dim=len(layers) * cfg.hidden_size, feature_layers=layers)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        pos = torch.arange(self.length, device=device).view(1, -1)
        meta = AttentionMetadata.build(pos, self.slot, self.length)
        meta.from_zero = True
        # the final norm's output at every position: the head runs at the positions asked for
        self.hidden = target.model(ids.view(1, -1), self.cache, meta)[0]  # [length, H]
        self.features = self.cache.features[0]                            # [length, W]
        self.cache.features = None  # the tree forwards past the prefix keep none

    @torch.no_grad()
    def greedy(self, points: list[int], drafted: torch.Tensor) -> torch.Tensor:
        """The target's greedy tokens [n, K] at x_p, y_1, .., y_{K-1} of each row (p in
        ``points``, each below the prefix's length; y = ``drafted`` [n, K]): the first column
        from the prefix, the rest from one tree forward of the n rows' y_1..y_{K-1}, each row a
        branch that sees the slot's keys up to its own p and its own earlier tokens (the
        speculator's tree mask with no speculation keys: ``tree_mask_full``, depth-major)."""
        n, k = drafted.shape
        device = drafted.device
        p = torch.tensor(points, device=device)
        first = self.target.lm_head(self.hidden[p]).argmax(-1).view(n, 1)
        if k == 1:
            return first
        t = n * (k - 1)
        if self.cache.tree_k is None or self.cache.tree_k.shape[3] < t:
            cfg = self.target.config
            shape = (cfg.num_hidden_layers, 1, self.target.kv_heads_local, t, cfg.head_dim)
            self.cache.tree_k = self.cache.k.new_zeros(shape)
            self.cache.tree_v = self.cache.v.new_zeros(shape)
        tree_len = self.cache.tree_k.shape[3]
        mask = torch.zeros(1, t, tree_len, dtype=torch.bool, device=device)
        mask[0, :, :t] = tree_mask_full(torch.zeros(n, dtype=torch.long, device=device), 0, k - 1)
        # token d * n + b: row b's y_{d+1}, at position p_b + 1 + d
        r = torch.arange(k - 1, device=device).view(-1, 1)
        meta = AttentionMetadata((p.view(1, -1) + 1 + r).view(1, -1), self.slot, self.length,
                                 kv_limit=(p + 1).repeat(k - 1).view(1, -1),
                                 tree_index=torch.arange(t, device=device).view(1, -1),
                                 tree_mask=mask, tree_len=tree_len)
        hidden = self.target.model(drafted[:, :k - 1].t().reshape(1, -1), self.cache, meta)[0]
        rest = self.target.lm_head(hidden).argmax(-1).view(k - 1, n).t()
        return torch.cat([first, rest], dim=1)


@torch.no_grad()
def acceptance_rows(draft: FeatureDraft, target, docs: Docs, k: int = 5, positions: int = 64,
                    m: int | Sequence[int] | None = None, seed: int = 0) -> list[dict]:
    """Greedy acceptance at up to ``positions`` sampled positions of ``docs`` with the target's
    features and self-conditioned: ``m`` (one count or several; default K + 1) positions whose
    features are the draft's own, every view on the same positions (sampled for the largest m).
    ``target``: any model with ``forward_full_features`` (a LlamaForCausalLM; for a fused draft
    it takes the layers too). Rows: view, k, self_conditioned (m), positions, tried, accepted,
    a_p, mean_accepted."""
    ms = [k + 1] if m is None else [m] if isinstance(m, int) else sorted(set(m))
    if k < 1 or not ms or min(ms) < 0:
        raise ValueError(f"need K >= 1 and self-conditioned counts >= 0, got K = {k}, m = {m}")
    device = next(draft.parameters()).device
    max_len = draft.rotary.cos.shape[0]
    points = sample_points(docs, positions, k, max(ms), max_len, seed)
    views = [("true features", 0)] + [("self-conditioned", mi) for mi in ms]
    accepted: list[list[int]] = [[] for _ in views]
    cached = hasattr(target, "kv_heads_local")  # else the cache-free reference forwards
    for d, ps in points.items():
        ids = torch.tensor(docs.ids[d][:max(ps) + 1], device=device)
        prefix = TargetPrefix(target, ids, draft.feature.layers) if cached else None
        features = (prefix.features if cached else
                    teacher_outputs(target, draft, ids[:max(ps)].unsqueeze(0))[1][0])
        for i, (_, view_m) in enumerate(views):
            drafted = draft_greedy(draft, ids, features, ps, k, view_m)
            accepted[i] += accepted_lengths(target, ids, ps, drafted, prefix)
    rows = []
    for (name, view_m), acc in zip(views, accepted):
        tried = sum(min(a + 1, k) for a in acc)
        rows.append({"view": name, "k": k, "self_conditioned": view_m, "positions": len(acc),
                     "tried": tried, "accepted": sum(acc), "a_p": sum(acc) / max(tried, 1),
                     "mean_accepted": sum(acc) / max(len(acc), 1)})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| view | self-conditioned positions | positions | tried | accepted | a_p | "
             "mean accepted (of K) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['view']} | {r['self_conditioned']} | {r['positions']} | {r['tried']} "
                     f"| {r['accepted']} | {r['a_p']:.3f} | {r['mean_accepted']:.2f} of "
                     f"{r['k']} |")
    return "\n".join(lines)


def self_conditioned_counts(text: str) -> list[int]:
    """``--self-conditioned``'s value: counts >= 0, comma-separated."""
    try:
        counts = [int(t) for t in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise argparse.ArgumentTypeError(f"expected counts >= 0 separated by commas, got {text!r}")
    return counts


def build_parser() -> argparse.ArgumentParser:
    from tools.distill.models import STORAGE_DTYPES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True, help="feature draft directory")
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--data-from", required=True,
                   help="a data.safetensors (tools/distill_data.py gen): its held-out split")
    p.add_argument("--k", type=int, default=5, help="draft tokens per position")
    p.add_argument("--positions", type=int, default=64, help="positions sampled")
    p.add_argument("--self-conditioned", type=self_conditioned_counts, default=None,
                   metavar="M[,M...]",
                   help="positions whose features are the draft's own in the self-conditioned "
                        "view(s) (default K + 1); several (e.g. 1,3,6) measure each on the same "
                        "positions")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=tuple(STORAGE_DTYPES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draft-vocab", type=draft_vocab_value, default="auto", metavar="auto|full|N",
                   help="the tokens the draft proposes: N (the first N of its ranking), full, or "
                        "auto (the default): the vocabulary it was trained over, else full")
    return p


def main(argv: list[str] | None = None) -> list[dict]:
    from ssdlib.errors import CheckpointError, ConfigError
    from ssdlib.loading import load_checkpoint
    from ssdlib.loading.draft_vocab import draft_token_ids
    from ssdlib.loading.feature_draft import load_feature_draft
    from tools.distill.data import load_splits
    from tools.distill.evaluate import trained_vocab
    from tools.distill.models import STORAGE_DTYPES, load_teacher

    a = build_parser().parse_args(argv)
    device, dtype = torch.device(a.device), STORAGE_DTYPES[a.dtype]
    try:
        ck = load_checkpoint(a.target)
        held_out = load_splits(a.data_from)[1]
        teacher = load_teacher(ck, device, dtype, ck.config.max_position_embeddings)
        vocab = trained_vocab(a.draft) if a.draft_vocab == "auto" else a.draft_vocab
        head_vocab = None if vocab == "full" else draft_token_ids(
            a.draft, vocab, ck.config.vocab_size, ck.config.eos_token_ids)
        draft = load_feature_draft(a.draft, ck, teacher, device, dtype,
                                   ck.config.max_position_embeddings, head_vocab=head_vocab)
        rows = acceptance_rows(draft, teacher, held_out, a.k, a.positions, a.self_conditioned,
                               a.seed)
    except (CheckpointError, ConfigError, ValueError, OSError) as e:
        raise SystemExit(str(e)) from None
    vocab_note = "" if head_vocab is None else f", draft vocabulary {vocab}"
    print(f"Greedy acceptance of feature draft `{a.draft}` beside `{a.target}` at sampled "
          f"held-out positions (K = {a.k}, {a.device}, {a.dtype}{vocab_note}):\n\n{table(rows)}")
    return rows


if __name__ == "__main__":
    main()
