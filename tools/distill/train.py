"""Knowledge distillation: the draft learns the target's next-token distributions.

Loss per position (``TrainSettings.loss``, over the full vocabulary): forward KL(target || draft)
in nats/token (``kl``, the default); the total variation distance TVD = 1/2 sum |p - q| (``tvd``),
which is exactly 1 - the probability that speculative sampling accepts a token the draft drew
(acceptance = sum min(p, q)), so it trains acceptance itself; or their sum (``kl+tvd``).
Evaluation on held-out target-written documents, at the positions that predict the target's
own output: KL, greedy agreement (draft argmax == target argmax, the per-token greedy acceptance
rate) and sampled acceptance (1 - TVD at temperature 1).

A checkpoint holds everything the next step depends on (weights, optimizer, step, RNG states, the
batcher's position; its shape: ``tools/distill/run_state.py``), so ``--resume`` continues the same
run. Frozen parameters (a draft's shared target embedding) are not in it: they are set from the
target again before resuming.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tools.distill.data import SOURCES, Batcher, Docs
from tools.distill.run_state import (SHARED_KEYS, capture_shared, read_state, restore_shared,
                                     write_state)

STATE_FILE = "last.pt"
TRAINER_KEYS = ("tokens_seen", "model")  # a Trainer's own keys in its run state


@dataclass
class TrainSettings:
    steps: int
    lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    schedule: str = "cosine"
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eval_every: int = 0
    save_every: int = 0
    eval_batch: int = 8
    seq_len: int = 512
    amp_dtype: torch.dtype | None = None  # autocast dtype for the draft (bf16 on GPU)
    loss: str = "kl"  # a key of LOSSES
    # the first this many steps train only the embedding and LM head (or the projections a
    # narrower shared-embedding draft reads the target's through); layers and norms wait, so a
    # draft whose input/output mapping was replaced (e.g. widened) keeps its layers
    embeddings_first: int = 0


EMBEDDING_PARAMS = ("model.embed_tokens.", "lm_head.")  # parameter names of that mapping


def lr_at(step: int, s: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``steps`` (or constant)."""
    if step < s.warmup:
        return s.lr * (step + 1) / s.warmup
    if s.schedule == "constant":
        return s.lr
    t = min(1.0, (step - s.warmup) / max(1, s.steps - s.warmup))
    return s.lr * (s.min_lr_ratio + (1 - s.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def teacher_log_probs(teacher_logits: torch.Tensor) -> torch.Tensor:
    """The teacher's log-probabilities [..., V] (float32) from its logits: what
    :func:`kl_from_log_probs` reads, computed once where several draft outputs meet the same
    teacher (the unroll steps of a feature draft)."""
    return F.log_softmax(teacher_logits.float(), dim=-1)


def kl_from_log_probs(draft_logits: torch.Tensor, teacher_logp: torch.Tensor) -> torch.Tensor:
    """KL(teacher || draft) in nats at each position, the teacher given as log-probabilities
    (:func:`teacher_log_probs`): logits [..., V] -> [...] (float32)."""
    d = F.log_softmax(draft_logits.float(), dim=-1)
    return (teacher_logp.exp() * (teacher_logp - d)).sum(-1)


def kl_per_position(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || draft) in nats at each position: logits [..., V] -> [...] (float32)."""
    return kl_from_log_probs(draft_logits, teacher_log_probs(teacher_logits))


def tvd_per_position(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Total variation distance 1/2 sum |p - q| at each position: logits [..., V] -> [...]
    (float32). 1 - TVD = sum min(p, q) is the chance that a token the draft drew is accepted."""
    d = F.softmax(draft_logits.float(), dim=-1)
    t = F.softmax(teacher_logits.float(), dim=-1)
    return 0.5 * (d - t).abs().sum(-1)


def _kl_plus_tvd(draft_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    return (kl_per_position(draft_logits, teacher_logits)
            + tvd_per_position(draft_logits, teacher_logits))


# the training losses per position (``--loss``)
LOSSES = {"kl": kl_per_position, "tvd": tvd_per_position, "kl+tvd": _kl_plus_tvd}


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def eval_batches(docs: Docs, seq_len: int, batch: int):
    """(ids [b, s], mask [b, s], source [b]) per batch of held-out documents, right-padded.

    mask[i, p] is True where logits at p predict a token of the target's own output
    (p + 1 >= score_from) and p + 1 is inside the document.
    """
    for start in range(0, len(docs), batch):
        rows = range(start, min(start + batch, len(docs)))
        lens = [min(len(docs.ids[i]), seq_len) for i in rows]
        s = max(lens)
        ids = torch.zeros(len(lens), s, dtype=torch.long)
        mask = torch.zeros(len(lens), s, dtype=torch.bool)
        for j, i in enumerate(rows):
            ids[j, :lens[j]] = torch.tensor(docs.ids[i][:lens[j]])
            mask[j, max(0, docs.score_from[i] - 1):lens[j] - 1] = True
        yield ids, mask, torch.tensor([docs.source[i] for i in rows])


@torch.no_grad()
def evaluate(draft, teacher, held_out: Docs, s: TrainSettings) -> dict:
    """Mean KL, greedy agreement and sampled acceptance (1 - TVD) over scored positions,
    overall and per source."""
    device = next(draft.parameters()).device
    was_training = draft.training
    draft.eval()
    sums: dict[str, list[float]] = {}  # source -> [kl sum, agreements, positions, acceptance]
    for ids, mask, source in eval_batches(held_out, s.seq_len, s.eval_batch):
        ids, mask = ids.to(device), mask.to(device)
        t_logits = teacher.forward_full(ids)
        with _autocast(device, s.amp_dtype):
            d_logits = draft.forward_full(ids)
        kl = kl_per_position(d_logits, t_logits)
        agree = (d_logits.argmax(-1) == t_logits.argmax(-1)).float()
        accept = 1.0 - tvd_per_position(d_logits, t_logits)
        for src in source.unique().tolist():
            m = mask & (source.to(device) == src).view(-1, 1)
            acc = sums.setdefault(SOURCES[src], [0.0, 0.0, 0.0, 0.0])
            acc[0] += float(kl[m].sum())
            acc[1] += float(agree[m].sum())
            acc[2] += float(m.sum())
            acc[3] += float(accept[m].sum())
    draft.train(was_training)
    total = [sum(v[i] for v in sums.values()) for i in range(4)]
    n = max(total[2], 1.0)
    return {"kl": total[0] / n, "agreement": total[1] / n, "acceptance": total[3] / n,
            "positions": int(total[2]),
            "by_source": {k: {"kl": v[0] / max(v[2], 1), "agreement": v[1] / max(v[2], 1),
                              "acceptance": v[3] / max(v[2], 1), "positions": int(v[2])}
                          for k, v in sums.items()}}


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor, params, step: int,
                   s: TrainSettings) -> None:
    """One optimiser step on ``loss`` at ``step``: the schedule's learning rate, the backward,
    gradients clipped to ``s.grad_clip`` (when > 0) over ``params``."""
    for g in opt.param_groups:
        g["lr"] = lr_at(step, s)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    if s.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(params, s.grad_clip)
    opt.step()


class Trainer:
    """Owns the draft's optimisation and its checkpoints in ``state_dir``."""

    def __init__(self, draft, teacher, batcher: Batcher, held_out: Docs, s: TrainSettings,
                 state_dir: str):
        self.draft, self.teacher, self.batcher, self.held_out, self.s = (
            draft, teacher, batcher, held_out, s)
        self.state_dir = state_dir
        self.device = next(draft.parameters()).device
        # frozen parameters (a shared target embedding) are neither optimised nor checkpointed
        trained = [p for p in draft.parameters() if p.requires_grad]
        decay = [p for p in trained if p.dim() > 1]
        other = [p for p in trained if p.dim() <= 1]
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": s.weight_decay},
             {"params": other, "weight_decay": 0.0}],
            lr=s.lr, betas=(0.9, 0.95), eps=1e-8,
            fused=self.device.type == "cuda")
        self.step = 0
        self.history: list[dict] = []
        self.tokens_seen = 0
        # wall time in evaluations and checkpoints (with their hooks), for a StepBudget
        self.eval_seconds = self.last_eval_seconds = 0.0
        self.save_seconds = self.last_save_seconds = 0.0
        self._frozen = {name for name, p in draft.named_parameters(remove_duplicate=False)
                        if not p.requires_grad}
        # trained parameters that wait for s.embeddings_first steps
        self._waiting = [p for name, p in draft.named_parameters()
                         if p.requires_grad and not name.startswith(EMBEDDING_PARAMS)]

    # -- checkpoints -------------------------------------------------------------------------
    @property
    def state_path(self) -> str:
        return os.path.join(self.state_dir, STATE_FILE)

    def save(self) -> None:
        """Write the run's state to ``state_path`` (``tools.distill.run_state``): the shared
        part, the tokens seen and the draft's state dict less its frozen parameters."""
        frozen = self._frozen_names()
        write_state({**capture_shared(self.step, self.opt, self.batcher, self.history),
                     "tokens_seen": self.tokens_seen,
                     "model": {k: v for k, v in self.draft.state_dict().items()
                               if k not in frozen}},
                    self.state_path)

    def load(self) -> None:
        """Go on from :meth:`save`'s state in ``state_path``: RunStateError naming the file
        when it is missing or unreadable, RuntimeError when it is another draft's."""
        state = read_state(self.state_path, (*SHARED_KEYS, *TRAINER_KEYS))
        frozen = self._frozen_names()
        missing, unexpected = self.draft.load_state_dict(state["model"], strict=False)
        if unexpected or set(missing) - frozen:
            raise RuntimeError(f"{self.state_path}: does not match the draft (missing "
                               f"{sorted(set(missing) - frozen)}, unexpected {unexpected})")
        self.step, self.history = restore_shared(state, self.opt, self.batcher)
        self.tokens_seen = int(state["tokens_seen"])

    def _frozen_names(self) -> set[str]:
        """State-dict names of parameters frozen from the start (all aliases: a tied head
        repeats its embedding); they come from the target, not from the checkpoint. (Those
        that wait for ``embeddings_first`` steps are trained ones, saved like the rest.)"""
        return self._frozen

    # -- training ----------------------------------------------------------------------------
    def train_on(self, ids: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
        """One optimiser step on ``ids`` [b, seq_len] against the teacher's logits for them
        (computed once and shared when several drafts train on the same batches:
        ``tools/distill/lockstep.py``). Returns the loss (on the device, not read)."""
        s = self.s
        if s.embeddings_first:  # frozen parameters get no gradient, so AdamW skips them
            for p in self._waiting:
                p.requires_grad_(self.step >= s.embeddings_first)
        with _autocast(self.device, s.amp_dtype):
            d_logits = self.draft.forward_full(ids)
        loss = LOSSES[s.loss](d_logits, t_logits).mean()
        optimizer_step(self.opt, loss, self.draft.parameters(), self.step, s)
        self.step += 1
        self.tokens_seen += ids.numel()
        return loss.detach()

    def run_eval(self) -> dict:
        t0 = time.perf_counter()
        result = {"step": self.step, "tokens": self.tokens_seen,
                  **evaluate(self.draft, self.teacher, self.held_out, self.s)}
        if not self.history or self.history[-1]["step"] != self.step:
            self.history.append(result)
        self.last_eval_seconds = time.perf_counter() - t0
        self.eval_seconds += self.last_eval_seconds
        return result

    def begin(self, on_eval: Callable[[dict], None] | None = None) -> None:
        """Before the first step of a run: training mode, and the step-0 evaluation unless
        the history (a resumed run's) has one."""
        self.draft.train()
        if not self.history:
            result = self.run_eval()
            if on_eval:
                on_eval(result)
        self._t0, self._tokens0 = time.perf_counter(), self.tokens_seen

    @property
    def done(self) -> bool:
        return self.step >= self.s.steps

    def after_step(self, loss: torch.Tensor,
                   on_step: Callable[[int, float | None, float | None], None] | None = None,
                   on_eval: Callable[[dict], None] | None = None,
                   on_save: Callable[[], None] | None = None) -> None:
        """The schedule after a step: report, evaluate and checkpoint when due (and at the
        last step)."""
        s = self.s
        last = self.step == s.steps
        if on_step:
            # reading the loss syncs with the GPU: only every few steps
            if self.step % 10 == 0 or last or self.step < 10:
                rate = (self.tokens_seen - self._tokens0) / max(
                    time.perf_counter() - self._t0, 1e-9)
                on_step(self.step, float(loss), rate)
            else:
                on_step(self.step, None, None)
        if (s.eval_every and self.step % s.eval_every == 0) or last:
            result = self.run_eval()
            if on_eval:
                on_eval(result)
        if (s.save_every and self.step % s.save_every == 0) or last:
            t0 = time.perf_counter()
            self.save()
            if on_save:
                on_save()
            self.last_save_seconds = time.perf_counter() - t0
            self.save_seconds += self.last_save_seconds
