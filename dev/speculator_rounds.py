"""SSD's speculator, driven round by round in one process, without a verifier or a second GPU.

The speculator rank's loop (``Speculator``: commit an OUTCOME, answer it, build the cache for
the speculation it answered and push it) runs here against :class:`LoopbackLink`, which keeps
what the speculator sends instead of sending it. A driver plays the leader: it keeps the
leader's copy of the pushed cache (``CacheMirror``, from the CACHE read back to the host as the
leader reads it) and makes each OUTCOME: with probability ``p_hit`` a cached outcome (k, t*)
(the leader's hit: the branch's tokens are the next speculation), otherwise a k and t* the
cache does not hold (a miss answered by the speculator's jit draft). One call of
:meth:`SpeculatorRounds.round` is the speculator's round from the OUTCOME to the CACHE on the
leader's host: what bounds an SSD round when the build outlasts the verify (T = 0.7).

Used by ``dev/hot_path_steps.py`` (``dev/step_times.py`` times it on one GPU). The tokens
are not a real decoding (the outcomes are drawn, not verified): the costs are the engine's.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from ssdlib.engine.leader.cache_mirror import CacheMirror
from ssdlib.distributed.protocol import Admit, AdmitRow, CacheRows, Choice, Outcome


class LoopbackLink:
    """The speculator's end of a link whose leader is this process: messages are kept."""

    def __init__(self):
        self.spec = None  # the last SPEC (protocol.Speculation)
        self.cache_rows: torch.Tensor | None = None  # the last CACHE as pushed (device)

    def send_spec(self, spec, tokens: bool = True, hold_q: bool = False) -> None:
        self.spec = spec

    def send_held_q(self) -> None:
        pass

    def send_cache(self, rows: torch.Tensor) -> None:
        self.cache_rows = rows

    def send_stats(self, stats) -> None:
        pass


class SpeculatorRounds:
    """One speculator (``draft`` on ``device``) serving ``b`` rows of ``params``; see the module
    doc. ``max_len``: rows are admitted afresh before they would outgrow it."""

    def __init__(self, draft_ck, vocab_size: int, device, dtype, b: int, k: int, budget: int,
                 params, p_hit: float = 0.7, max_len: int = 1024, prompt_len: int = 40,
                 seed: int = 0):
        from ssdlib.engine.runner.model_runner import ModelRunner
        from ssdlib.engine.drafter import Drafter
        from ssdlib.engine.speculator.speculator import CacheRole, Speculator, tree_len_of

        self.cfg = SimpleNamespace(k=k, fan_out="auto", fan_out_budget=budget, max_batch=b,
                                   fan_out_tuning=False, saguaro_c=1.0, fallback="jit",
                                   mode="ssd")
        self.device = torch.device(device)
        runner = ModelRunner(draft_ck, None, self.device, dtype, b, max_len + k + 2,
                             tree_len=tree_len_of(self.cfg),
                             cuda_graphs=self.device.type == "cuda")
        self.link = LoopbackLink()
        drafter = Drafter(runner, vocab_size)
        self.spec = Speculator(self.cfg, runner, self.link, vocab_size, drafter,
                               CacheRole(self.cfg, runner, drafter, vocab_size))
        self.V, self.K, self.b = vocab_size, k, b
        self.params, self.p_hit = params, p_hit
        self.max_len, self.prompt_len = max_len, prompt_len
        self.rand = random.Random(seed)
        self.mirror = CacheMirror()
        self.B = self.spec.cache.B
        self.hits = self.rounds = 0
        self._admit()

    def _admit(self) -> None:
        """Every row joins afresh (a prompt of random tokens) and gets its first speculation."""
        rows = [AdmitRow(slot, [self.rand.randrange(self.V) for _ in range(self.prompt_len)],
                         slot, self.params) for slot in range(self.b)]
        for slot in range(self.b):
            self.mirror.forget(slot)
        self.spec.admit(Admit(rows))
        first = [self.rand.randrange(self.V) for _ in range(self.b)]
        self._exchange(Outcome(list(range(self.b)), [0] * self.b, first, [True] * self.b,
                               sampling=not self.params.greedy, k=self.K))

    def _exchange(self, outcome: Outcome) -> None:
        """The speculator's round for ``outcome``, then the CACHE read on the leader's host."""
        self.spec.sampling = outcome.sampling
        self.spec.timer.start()  # as the rank's loop does on an OUTCOME: its phases are timed
        if not self.spec.respond(outcome):
            raise RuntimeError("speculator_rounds: no live row")
        self.spec.after_answer()
        self.spec.end_round()
        rows = self.link.cache_rows.cpu()  # the leader's read-back of the CACHE
        self.mirror.update(outcome.slots, CacheRows.unpack(rows, self.B, self.K))

    def _outcome(self) -> Outcome:
        """The next OUTCOME: per row a cached (k, t*) with probability p_hit, else a miss."""
        accepted, bonus, choice, arg, tokens = [], [], [], [], []
        for slot in range(self.b):
            row = self.mirror.rows.get(slot)
            if row is not None and row.keys and self.rand.random() < self.p_hit:
                (k, t), j = self.rand.choice(sorted(row.keys.items()))
                accepted.append(k)
                bonus.append(t)
                choice.append(int(Choice.CACHE))
                arg.append(j)
                tokens.append(row.tokens[j])
                self.hits += 1
                continue
            held = row.keys if row is not None else {}
            k = self.rand.randrange(self.K + 1)
            t = self.rand.randrange(self.V)
            while (k, t) in held:
                t = self.rand.randrange(self.V)
            accepted.append(k)
            bonus.append(t)
            choice.append(int(Choice.JIT))
            arg.append(0)
            tokens.append([0] * self.K)
        return Outcome(list(range(self.b)), accepted, bonus, [True] * self.b,
                       sampling=not self.params.greedy, k=self.K, choice=choice, arg=arg,
                       tokens=tokens)

    @torch.inference_mode()
    def round(self) -> None:
        """One OUTCOME round (rows admitted afresh first when they are about to outgrow
        ``max_len``: that call also pays their prefill)."""
        longest = max(len(r.tokens) for r in self.spec.rows.values())
        if longest + 2 * (self.K + 1) >= self.max_len:
            self._admit()
        self.rounds += self.b
        self._exchange(self._outcome())

    def phases_ms(self) -> dict[str, float]:
        """The speculator's own phase times (SPEC_PHASES, CUDA events on a GPU), ms per round
        over the rounds so far (admissions' first exchanges included)."""
        n = max(self.spec.rounds, 1)
        return {name: 1e3 * t / n for name, t in self.spec.phase_s.items()}
