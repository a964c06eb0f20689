"""Training a feature draft (``ssdlib.models.feature_draft``) on its target: distillation with
self-conditioning (training-time test).

Per batch of token rows ids [b, s] the target computes once, without gradients, its logits T and
the features the draft reads at every position (``teacher_outputs``: its last layer's output, or
for a fused draft three layers' outputs concatenated), conditioned by the draft to f = its own
width (``FeatureDraft.condition``: the identity, or the draft's ``fuse``, trained with the rest).
The draft's inputs are positions t = 0..s-2: the token x_{t+1} = ids[:, t+1] and a feature. Its
logits at t are compared with T at t+1 (the target's distribution of x_{t+2}), its hidden output
h_t with f at t+1 (the feature it estimates, held without gradient: for a fused draft the
regression then does not pull ``fuse`` towards what h finds easy). Every position of a packed
row counts; the row's last token has no successor and is no input.

Unrolling (``ttt_steps`` steps): step 0 reads the target's (conditioned) features f_t; step
j >= 1 reads, at every position t >= 1, the draft's own hidden output of step j-1 at position
t-1 (its estimate of f_t; position 0 keeps f_0). A position t at step j thus sees a feature
predicted through min(j, t) levels of the draft's own estimates, as when the draft runs past the
positions whose target features exist (SD: the tokens it drafts; SSD: also the positions still
being verified). The token loss (``LOSSES``: forward KL or TVD per position) and a feature
regression term (smooth L1 between h_t and f_{t+1}, weighted) are taken at every step and
averaged over steps; gradients flow through the unrolling.

The keys a step's queries attend to (``FeatureTrainSettings.ttt_keys``): with "uniform" step j
is one causal forward in which every position reads depth-j features, also the positions a
query attends to as keys and values, where at inference the earlier positions of that context
have shallower (or the target's) features. With "inference" (the default) step j is exactly
the draft at inference: every layer keeps the keys and values of steps 0..j-1, and its mask
(``inference_keys_mask``) lets a query of step j at position t see, for e = max(t - j, 0), the
keys of positions <= e from step 0 and the key of each later position p <= t from step p - e,
as the draft's KV cache holds them when it has the target's features up to e and its own after
(tested against a position-by-position rollout). It costs more: step j attends over (j + 1)
blocks of keys through a masked kernel instead of a causal one.

Token gain (``FeatureTrainSettings.token_gain``, c): the features are pre-norm and much larger
than the token embeddings (SmolLM2-135M: RMS ~32 against ~0.12, c ~ 265), so with fc's columns
alike the token half of fc([embed(x_{t+1}), f_t]) starts ~c times weaker and AdamW, whose steps
are alike in absolute size, takes ~c times longer to grow it: the draft learns to use x_{t+1}
(the very token whose consequence it predicts) slowly. Training therefore holds fc's token
columns as c * W' and optimises W' (a parametrisation during ``run``, removed after it: the
stored fc is the plain product, the format and the engine unchanged), and ``init_feature_draft``
starts them c times larger, so both halves contribute alike from the start and learn alike.
``token_gain_for`` measures c on a batch. A fresh fused draft's ``fuse`` starts as the
selection of its highest layer's output (``init_feature_draft``), so it starts as a draft of that
layer's features and learns from there what the lower layers add.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from ssdlib.layers.rotary import apply_rotary
from ssdlib.layers.subset_head import SubsetLMHead
from ssdlib.models.feature_draft import FeatureDraft
from tools.distill.data import Batcher, Docs
from tools.distill.run_state import SHARED_KEYS, capture_shared, require_keys, restore_shared
from tools.distill.train import (LOSSES, TrainSettings, _autocast, eval_batches,
                                 kl_from_log_probs, kl_per_position, optimizer_step,
                                 teacher_log_probs)


@dataclass
class FeatureTrainSettings(TrainSettings):
    ttt_steps: int = 3  # unroll steps per training step (1: the target's features only)
    # the keys an unroll step's queries attend to: "inference" (as the draft's KV cache holds
    # them at inference: ``inference_keys_mask``) or "uniform" (all at the step's depth)
    ttt_keys: str = "inference"
    feature_loss_weight: float = 0.1  # weight of the smooth-L1 feature regression term
    # unroll steps measured on held-out data, the same whatever ttt_steps, so runs compare
    eval_depth: int = 4
    # fc's token columns trained as token_gain * W' (module doc; 1: plain)
    token_gain: float = 1.0
    # the KL loss through torch.compile: on a GPU its softmaxes, products and sums become a few
    # fused kernels instead of a dozen passes over [positions, vocabulary] float32 tensors
    compile_loss: bool = False
    # the teacher's forward (logits and features of a training batch) through torch.compile
    compile_teacher: bool = False

    def __post_init__(self):
        if self.ttt_steps < 1 or self.eval_depth < 1:
            raise ValueError(f"ttt_steps and eval_depth must be at least 1, got "
                             f"{self.ttt_steps} and {self.eval_depth}")
        if self.ttt_keys not in TTT_KEYS:
            raise ValueError(f"ttt_keys must be one of {TTT_KEYS}, got {self.ttt_keys!r}")
        if not self.token_gain > 0:
            raise ValueError(f"the token gain must be positive, got {self.token_gain}")
        if self.feature_loss_weight < 0:
            raise ValueError(f"the feature loss weight must be >= 0, got "
                             f"{self.feature_loss_weight}")
        if self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}: choose from {', '.join(LOSSES)}")


def teacher_outputs(teacher, draft: FeatureDraft,
                    ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``teacher``'s logits [b, s, V] and the features [b, s, W] ``draft`` reads (its
    ``feature_width``) over ``ids`` [b, s], in one forward: the last layer's output before the
    final norm (the teacher's default), or the fused layers' outputs concatenated."""
    if draft.feature.layers is None:
        return teacher.forward_full_features(ids)
    return teacher.forward_full_features(ids, draft.feature.layers)


@torch.no_grad()
def token_gain_for(draft: FeatureDraft, teacher, ids: torch.Tensor) -> float:
    """The token gain c for ``teacher``'s features (module doc): the median over positions t of
    ``ids`` [b, s] of RMS(f_t) / RMS(embed(x_{t+1})), position 0 (an attention sink's outsized
    feature) left out. f_t: the (highest) layer output a fresh draft's fc first reads (a fused
    draft's ``fuse`` starts as its selection: ``init_feature_draft``)."""
    h = draft.config.hidden_size
    features = teacher_outputs(teacher, draft, ids)[1][:, 1:-1, -h:].float()
    embeds = draft.embed_tokens(ids[:, 2:]).float()
    rms = lambda x: x.pow(2).mean(-1).sqrt()  # noqa: E731
    return float((rms(features) / rms(embeds).clamp_min(1e-12)).median())


class _TokenGain(nn.Module):
    """fc's weight [H, 2H] as W' with its first H (token) columns times ``gain``."""

    def __init__(self, hidden: int, gain: float):
        super().__init__()
        scale = torch.ones(2 * hidden)
        scale[:hidden] = gain
        self.register_buffer("scale", scale)

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return w * self.scale.to(w.dtype)

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w / self.scale.to(w.dtype)


@torch.no_grad()
def init_feature_draft(draft: FeatureDraft, target, seed: int,
                       init_layer: int | None = None, token_gain: float = 1.0) -> None:
    """A fresh draft: N(0, 0.02) matrices, the residual output projections scaled down by
    sqrt(2 * layers), unit layer norms; the final norm := the target's (h_t estimates a target
    feature, which the target's norm maps to its logits). ``init_layer``: every draft layer :=
    that layer of the target (``target``: the teacher, a LlamaForCausalLM). ``token_gain``: fc's
    token columns start that many times larger (module doc). A fused draft's ``fuse`` [H, 3H]
    := [0, 0, I]: the highest fused layer's output passes through, the others start unused."""
    n = len(target.model.layers)
    if init_layer is not None and not 0 <= init_layer < n:
        raise ValueError(f"--init-layer-from-target {init_layer}: the target has layers "
                         f"0..{n - 1}")
    g = torch.Generator().manual_seed(seed)
    for p in draft.parameters():  # norms are 1-D
        p.copy_(torch.randn(p.shape, generator=g) * 0.02 if p.dim() > 1 else torch.ones(p.shape))
    out_scale = 1.0 / math.sqrt(2 * len(draft.layers))
    for layer in draft.layers:  # as GPT-2: the residual stream grows with depth
        layer.self_attn.o_proj.weight.mul_(out_scale)
        layer.mlp.down_proj.weight.mul_(out_scale)
    h = draft.config.hidden_size
    draft.fc.weight[:, :h] *= token_gain
    if draft.fuse is not None:
        draft.fuse.weight.zero_()
        draft.fuse.weight[:, -h:] = torch.eye(h)
    draft.norm.load_state_dict(target.model.norm.state_dict())
    if init_layer is not None:
        for layer in draft.layers:
            layer.load_state_dict(target.model.layers[init_layer].state_dict())


@torch.no_grad()
def grow_feature_draft(draft: FeatureDraft, target, layers: int,
                       init_layer: int | None = None) -> FeatureDraft:
    """``draft`` with ``layers`` more decoder layers after its own, computing exactly what it
    computed: each new layer starts as a copy of the draft's last layer (``init_layer``: of
    that layer of ``target``, the teacher) with its two residual output projections (attention
    ``o_proj``, MLP ``down_proj``) zero, so it adds nothing to the residual stream until
    training moves them (they are the first to get gradients). fc, fuse, the old layers and the
    norm are ``draft``'s. A deeper draft this way keeps what the shallower one learned, where a
    fresh one would start over."""
    if layers < 1:
        raise ValueError(f"--grow-layers must be at least 1, got {layers}")
    n = len(target.model.layers)
    if init_layer is not None and not 0 <= init_layer < n:
        raise ValueError(f"--init-layer-from-target {init_layer}: the target has layers "
                         f"0..{n - 1}")
    weight = draft.fc.weight
    with torch.device(weight.device):
        grown = FeatureDraft.for_target(target, len(draft.layers) + layers,
                                        draft.rotary.cos.shape[0], draft.feature)
    missing, unexpected = grown.load_state_dict(draft.state_dict(), strict=False)
    old = len(draft.layers)
    new_keys = [k for k in missing if not any(k.startswith(f"layers.{i}.")
                                              for i in range(old, len(grown.layers)))]
    if unexpected or new_keys:  # cannot happen for two drafts of one target: a guard
        raise ValueError(f"growing the draft: unexpected {unexpected}, missing {new_keys}")
    source = target.model.layers[init_layer] if init_layer is not None else draft.layers[-1]
    for layer in grown.layers[old:]:
        layer.load_state_dict(source.state_dict())
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    return grown.requires_grad_(draft.fc.weight.requires_grad)


def shifted(ids: torch.Tensor, logits: torch.Tensor, features: torch.Tensor):
    """The draft's view of a batch the target ran over (ids [b, s], its logits and features):
    (next_ids [b, s-1], features [b, s-1, W], target logits [b, s-1, V], target features
    [b, s-1, W]) of draft positions t = 0..s-2: x_{t+1}, F_t, T_{t+1}, F_{t+1}."""
    return ids[:, 1:], features[:, :-1], logits[:, 1:], features[:, 1:]


TTT_KEYS = ("inference", "uniform")  # what a query of unroll step j attends to (module doc)


def unroll(draft: FeatureDraft, features: torch.Tensor, next_ids: torch.Tensor,
           steps: int, keys: str = "uniform") -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(logits, hidden) of each unroll step: step 0 on the target's ``features`` [b, s, W]
    (conditioned here: ``FeatureDraft.condition``), step j on the hidden output of step j-1
    shifted one position on (position 0 keeps its feature). ``keys``: "uniform", every key of
    step j at step j's depth (one causal forward a step); "inference", the keys a draft meets
    at inference (:func:`inference_keys_mask`; each layer keeps every step's keys and values
    for the steps after it)."""
    if keys not in TTT_KEYS:
        raise ValueError(f"unroll keys must be one of {TTT_KEYS}, got {keys!r}")
    if keys == "inference" and draft.config.sliding_window is not None:
        raise ValueError("inference-keyed unrolling covers drafts without a sliding window")
    first = draft.condition(features)
    feats = first
    past: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in draft.layers]
    for j in range(steps):
        if keys == "uniform":
            logits, hidden = draft.forward_full(feats, next_ids)
        else:
            hidden = _inference_keyed_step(draft, feats, next_ids, past, j)
            logits = draft.logits(hidden)
        yield logits, hidden
        feats = torch.cat([first[:, :1], hidden[:, :-1].to(first.dtype)], dim=1)


def _inference_keyed_step(draft: FeatureDraft, feats: torch.Tensor, next_ids: torch.Tensor,
                          past: list[list[tuple[torch.Tensor, torch.Tensor]]],
                          j: int) -> torch.Tensor:
    """Unroll step j with the keys of inference -> its hidden output [b, s, H]: each decoder
    layer's queries attend to the keys and values of steps 0..j at that layer (``past[i]``:
    layer i's (k, v) [b, s, hkv, hd] of steps 0..j-1; this step's are appended) under
    :func:`inference_keys_mask`. ``LlamaDecoderLayer.forward``'s computation with the layer's
    own modules (norms, projections, rotary, MLP), the attention through SDPA over those keys
    (tested against a position-by-position rollout of the draft itself)."""
    b, s = next_ids.shape
    x = draft.pair_inputs(next_ids, feats)
    cos, sin = draft.rotary.cos_sin(torch.arange(s, device=x.device).expand(b, s))
    for layer, kept in zip(draft.layers, past):
        attn = layer.self_attn
        q, k, v = attn.qkv_proj(layer.input_layernorm(x))
        q = q.view(b, s, attn.q_local, attn.head_dim)
        k = k.view(b, s, attn.kv_local, attn.head_dim)
        v = v.view(b, s, attn.kv_local, attn.head_dim)
        q, k = apply_rotary(q, k, cos.to(q.dtype), sin.to(q.dtype))
        kept.append((k, v))
        # [b, hq, (j + 1) s, hd]: every query head's copy of its key / value head, so that a
        # GPU's memory-efficient kernel (no enable_gqa) takes the masked attention
        group = attn.q_local // attn.kv_local
        keys, values = (torch.cat([t[i] for t in kept], dim=1).transpose(1, 2)
                        .repeat_interleave(group, dim=1) for i in (0, 1))
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, scale=attn.attn.scale,
            attn_mask=_additive_keys_mask(s, j, x.device, q.dtype))
        x = x + attn.o_proj(out.transpose(1, 2).reshape(b, s, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


@functools.lru_cache(maxsize=16)
def _additive_keys_mask(s: int, step: int, device: torch.device,
                        dtype: torch.dtype) -> torch.Tensor:
    """:func:`inference_keys_mask` as SDPA's additive mask in ``dtype`` (0 or -inf), a view of
    rows padded to a multiple of 16 elements (the memory-efficient kernel's alignment); made
    once per shape, device and dtype."""
    mask = inference_keys_mask(s, step, device)
    n = mask.shape[1]
    padded = torch.full((s, -(-n // 16) * 16), float("-inf"), dtype=dtype, device=device)
    padded[:, :n].masked_fill_(mask, 0.0)
    return padded[:, :n]


def inference_keys_mask(s: int, step: int, device: torch.device) -> torch.Tensor:
    """The attention mask [s, (step + 1) * s] (bool: True attends) of unroll step ``step``'s
    queries over the keys of steps 0..step side by side, each a block of positions 0..s-1. A
    query at position t stands for the draft at inference having the target's features up to
    position e = max(t - step, 0) and its own after: it sees the keys of positions <= e from
    step 0 (the target's features) and the key of each later position p <= t from step p - e
    (its own features, p - e levels deep), as the draft's KV cache holds them then."""
    t = torch.arange(s, device=device)
    e = (t - step).clamp(min=0).view(s, 1, 1)                            # [tq, 1, 1]
    dk = torch.arange(step + 1, device=device).view(1, -1, 1)            # [1, dk, 1]
    p = t.view(1, 1, -1)                                                 # [1, 1, p]
    seen = p <= t.view(s, 1, 1)
    mask = seen & (((dk == 0) & (p <= e)) | ((dk >= 1) & (p == e + dk)))
    return mask.reshape(s, (step + 1) * s)


def unrolled_losses(draft: FeatureDraft, ids: torch.Tensor, t_logits: torch.Tensor,
                    t_features: torch.Tensor, s: FeatureTrainSettings) -> list[torch.Tensor]:
    """The loss of each of the ``s.ttt_steps`` unroll steps on ``ids`` [b, s], given the
    target's logits and features for them (``teacher_outputs``)."""
    next_ids, feats, target_logits, target_feats = shifted(ids, t_logits, t_features)
    if s.feature_loss_weight:  # what h_t estimates: f_{t+1}, held (module doc)
        target_feats = draft.condition(target_feats).detach()
    token_loss = _token_loss(target_logits, s)
    losses = []
    for logits, hidden in unroll(draft, feats, next_ids, s.ttt_steps, s.ttt_keys):
        loss = token_loss(logits).mean()
        if s.feature_loss_weight:
            regression = F.smooth_l1_loss(hidden.float(), target_feats.float())
            loss = loss + s.feature_loss_weight * regression
        losses.append(loss)
    return losses


@functools.cache
def compiled_kl() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``kl_from_log_probs`` through torch.compile (one compiled function per process; a new
    shape, such as the long rows', compiles once more)."""
    return torch.compile(kl_from_log_probs, dynamic=False)


def _token_loss(target_logits: torch.Tensor,
                s: FeatureTrainSettings) -> Callable[[torch.Tensor], torch.Tensor]:
    """The per-position token loss of draft logits against ``target_logits`` (``s.loss``).
    For KL the teacher's log-probabilities are computed once, for every unroll step, and the
    KL is compiled when ``s.compile_loss``."""
    if s.loss != "kl":
        return lambda logits: LOSSES[s.loss](logits, target_logits)
    t_logp = teacher_log_probs(target_logits)
    kl = compiled_kl() if s.compile_loss else kl_from_log_probs
    return lambda logits: kl(logits, t_logp)


@torch.no_grad()
def evaluate_unrolled(draft: FeatureDraft, teacher, held_out: Docs,
                      s: FeatureTrainSettings, vocab: "DraftVocab | None" = None) -> dict:
    """Held-out KL(target || draft) and greedy agreement at each unroll depth 0..eval_depth-1
    (depth 0: the target's features; depth d: features through d levels of the draft's own),
    over the positions that predict the target's own output. With a draft vocabulary (``draft``
    then its view over it, ``DraftVocab.view``) the KL is over its tokens (the target's
    distribution renormalised there, as trained) and agreement is with the target's greedy
    token over the whole vocabulary (one outside the draft's never agrees)."""
    device = next(draft.parameters()).device
    kl = torch.zeros(s.eval_depth, dtype=torch.float64)
    agree = torch.zeros(s.eval_depth, dtype=torch.float64)
    n = 0
    for ids, mask, _ in eval_batches(held_out, s.seq_len, s.eval_batch):
        ids, mask = ids.to(device), mask.to(device)
        next_ids, feats, t_logits, _ = shifted(ids, *teacher_outputs(teacher, draft, ids))
        scored = mask[:, 1:]  # draft position t is scored where the target's t + 1 is
        t_kept = t_logits if vocab is None else vocab.of_target(t_logits)  # what the KL reads
        t_greedy = t_logits.argmax(-1)  # over the whole vocabulary
        with _autocast(device, s.amp_dtype):
            steps = unroll(draft, feats, next_ids, s.eval_depth, s.ttt_keys)
            for depth, (logits, _) in enumerate(steps):
                kl[depth] += float(kl_per_position(logits, t_kept)[scored].sum())
                guess = logits.argmax(-1) if vocab is None else vocab.token(logits.argmax(-1))
                agree[depth] += float((guess == t_greedy)[scored].sum())
        n += int(scored.sum())
    n_safe = max(n, 1)
    return {"kl": (kl / n_safe).tolist(), "agreement": (agree / n_safe).tolist(), "positions": n}


class _SubsetLogits(nn.Module):
    """A draft vocabulary's head as training sees it: the logits of its tokens alone."""

    def __init__(self, head: SubsetLMHead):
        super().__init__()
        self.head = head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head.rows(x)


class DraftVocab:
    """Training over a draft vocabulary (EAGLE-3's reduced head): the draft's logits over the
    tokens ``token_ids`` only (the same rows of the target's head), the target's logits cut to
    the same columns, so the KL is over those tokens, the target's distribution renormalised
    there: what the draft's distribution is when it runs with that vocabulary. Positions where
    the target's own token lies outside teach the draft the renormalised rest."""

    def __init__(self, draft: FeatureDraft, token_ids: torch.Tensor):
        self.head = SubsetLMHead.of(draft.lm_head, token_ids)
        self.token_ids = self.head.token_ids
        self._view = draft.with_head(_SubsetLogits(self.head))

    @property
    def view(self) -> FeatureDraft:
        """The draft with the vocabulary's head (the same modules and parameters)."""
        return self._view

    def of_target(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's logits [..., V] at the vocabulary's tokens: [..., n]."""
        return logits.index_select(-1, self.token_ids)

    def token(self, index: torch.Tensor) -> torch.Tensor:
        """Token ids of positions in the vocabulary (an argmax over its logits)."""
        return self.token_ids[index]


FEATURE_KEYS = ("steps", "params")  # a FeatureTrainer's own keys in its run state


class FeatureTrainer:
    """A feature draft's optimisation against its target (the teacher) on ``batcher``'s rows,
    evaluated on ``held_out`` documents."""

    def __init__(self, draft: FeatureDraft, teacher, batcher: Batcher, held_out: Docs,
                 s: FeatureTrainSettings, vocab: torch.Tensor | None = None):
        self.draft, self.teacher, self.batcher, self.held_out, self.s = (
            draft, teacher, batcher, held_out, s)
        # vocab (token ids): train over those tokens only (DraftVocab); self.view is the draft
        # the losses run (the same parameters)
        self.vocab = DraftVocab(draft, vocab) if vocab is not None else None
        self.view = self.vocab.view if self.vocab is not None else draft
        self.device = next(draft.parameters()).device
        # the parameters are the same objects with the token gain's parametrisation on or off
        # (it keeps fc's weight tensor as its ``original``), so one optimizer serves both
        params = list(draft.parameters())  # the target's embedding and head are not among them
        self.opt = torch.optim.AdamW(
            [{"params": [p for p in params if p.dim() > 1], "weight_decay": s.weight_decay},
             {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0}],
            lr=s.lr, betas=(0.9, 0.95), eps=1e-8)
        self.teacher_outputs = (torch.compile(teacher_outputs, dynamic=False)
                                if s.compile_teacher else teacher_outputs)
        self.step = 0
        self.history: list[dict] = []
        # what a time budget (tools/distill/budget.py) reads: evaluations' seconds; the draft is
        # saved once, after the run (left to the budget's reserve)
        self.eval_seconds = self.last_eval_seconds = 0.0
        self.save_seconds = self.last_save_seconds = 0.0

    @property
    def done(self) -> bool:
        return self.step >= self.s.steps

    @property
    def gained(self) -> bool:
        """Whether fc's token columns are now trained through the token gain."""
        return parametrize.is_parametrized(self.draft.fc, "weight")

    def _gain(self, on: bool) -> None:
        """Put the token gain's parametrisation on fc (the function unchanged: fc's weight
        tensor then holds W'), or take it off (the tensor holds the plain weight again)."""
        if self.s.token_gain == 1.0 or on == self.gained:
            return
        if on:
            parametrize.register_parametrization(
                self.draft.fc, "weight", _TokenGain(self.draft.config.hidden_size,
                                                    self.s.token_gain).to(self.device))
        else:
            parametrize.remove_parametrizations(self.draft.fc, "weight", leave_parametrized=True)

    def train_on(self, ids: torch.Tensor) -> torch.Tensor:
        """One optimiser step on ``ids`` [b, seq_len] (through the token gain, which ``run``
        puts on); returns the loss (not read)."""
        s = self.s
        with torch.no_grad():
            t_logits, t_features = self.teacher_outputs(self.teacher, self.draft, ids)
            if self.vocab is not None:
                t_logits = self.vocab.of_target(t_logits)
        with _autocast(self.device, s.amp_dtype):
            loss = torch.stack(unrolled_losses(self.view, ids, t_logits, t_features, s)).mean()
        optimizer_step(self.opt, loss, self.draft.parameters(), self.step, s)
        self.step += 1
        return loss.detach()

    def run_eval(self) -> dict:
        t0 = time.perf_counter()
        result = {"step": self.step,
                  **evaluate_unrolled(self.view, self.teacher, self.held_out, self.s,
                                      self.vocab)}
        self.history.append(result)
        self.last_eval_seconds = time.perf_counter() - t0
        self.eval_seconds += self.last_eval_seconds
        return result

    def run(self, on_step: Callable[[int, torch.Tensor], None] | None = None,
            on_eval: Callable[[dict], None] | None = None, budget=None,
            stop: Callable[[int], bool] | None = None,
            on_stop: Callable[[dict], None] | None = None) -> list[dict]:
        """Evaluate, train to ``steps`` (evaluating every ``eval_every`` steps and at the end);
        returns the evaluations. ``budget`` (a ``tools.distill.budget.StepBudget``) may lower
        ``steps`` once, early, so that the run ends on time (its schedule with it). ``stop``
        (asked before each step with the step count) ends the run early, after an evaluation;
        ``on_stop`` then gets :meth:`state`, from which a later :meth:`restore` goes on with
        the same schedule."""
        s = self.s
        self._gain(True)
        try:
            if not self.history or self.history[-1]["step"] != self.step:
                self._evaluate(on_eval)
            while self.step < s.steps:
                if budget is not None:
                    budget.before_step([self])
                    if self.done:
                        break
                if stop is not None and stop(self.step):
                    break
                loss = self.train_on(self.batcher.next().to(self.device))
                if on_step:
                    on_step(self.step, loss)
                if (s.eval_every and self.step % s.eval_every == 0) or self.step == s.steps:
                    self._evaluate(on_eval)
            if self.history[-1]["step"] != self.step:
                self._evaluate(on_eval)
            if not self.done and on_stop is not None:
                on_stop(self.state())  # fc as the optimizer sees it: through the token gain
        finally:  # the draft leaves as it is stored: a plain fc
            self._gain(False)
        return self.history

    # -- a run over several calls --------------------------------------------------------------
    def state(self) -> dict:
        """Everything the next step depends on (on the CPU): the shared part of a run state
        (``tools.distill.run_state``: the step, the optimizer's moments, the batcher's place, the
        evaluations so far, the RNG states), the schedule's length and the trained tensors as
        the optimizer holds them (fc's through the token gain, so no rounding comes between the
        calls)."""
        return {**capture_shared(self.step, self.opt, self.batcher, self.history),
                "steps": self.s.steps,
                "params": {n: p.detach().to("cpu", copy=True)
                           for n, p in self.draft.named_parameters()}}

    def restore(self, state: dict) -> None:
        """Go on from :meth:`state` of a run of the same draft, settings and data: the draft's
        tensors, the optimizer, the step, the schedule's length and the batcher's place.
        ValueError (a RunStateError where a key is missing) when it is not such a state."""
        require_keys(state, (*SHARED_KEYS, *FEATURE_KEYS), "the saved run's state")
        self._gain(True)
        params = dict(self.draft.named_parameters())
        saved = state["params"]
        if set(params) != set(saved) or any(saved[n].shape != p.shape for n, p in params.items()):
            raise ValueError("the saved run's draft is not this one (its tensors "
                             f"{sorted(saved)} against {sorted(params)})")
        with torch.no_grad():
            for n, p in params.items():
                p.copy_(saved[n])
        self.step, self.history = restore_shared(state, self.opt, self.batcher)
        self.s.steps = int(state["steps"])

    def _evaluate(self, on_eval: Callable[[dict], None] | None) -> None:
        result = self.run_eval()
        if on_eval:
            on_eval(result)
