"""The engine configuration shared by the CLI, ``Generator`` and every rank (a small dataclass).

Validated once, with clear errors, before any process is started.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from ssdlib.distributed.host_cpu import available_cores, cpu_speculator_placement, native_bf16
from ssdlib.engine.runner.compiled import compile_setting
from ssdlib.engine.runner.model_runner import POSITION_SLACK
from ssdlib.errors import ConfigError, require_int
from ssdlib.loading.draft_vocab import (DRAFT_VOCAB_FILE, draft_token_ids, ranking_path,
                                        trained_size)
from ssdlib.loading.feature_draft import is_feature_draft
from ssdlib.loading.registry import default_draft
from ssdlib.speculative.fanout import parse_fanout

MODES = ("ar", "sd", "ssd")
DEVICES = ("auto", "cpu", "cuda")
PLACEMENTS = ("auto", "stream", "rank")
FALLBACKS = ("auto", "jit", "ngram", "random")
# --fan-out-budget by device. On one H200 SmolLM2-135M at b = 1 was fastest with 16 branches a
# row (docs/BENCHMARKS.md, 2026-12-04; chained rounds then tune it, speculative/fanout_budget.py).
# On a CPU the build is bound by its FLOPs (every branch through the draft and its LM head): on
# 2 cores, SSD with the speculator on a rank of its own ran 1.22-1.28x as fast with 8 as with 16
# at b = 1 and 1.33x at b = 4 (docs/BENCHMARKS.md, 2026-12-04)
DEFAULT_FAN_OUT_BUDGET = {"cuda": 16, "cpu": 8}
# --draft-vocab auto, by device, for a draft that ships a ranking of its vocabulary
# (ssdlib.loading.draft_vocab): the tokens its LM head scores. On a CPU the head is most of a
# draft's time (ssdlib.layers.subset_head); on a GPU it is not (one H200: within 1 %), the full
# vocabulary
DEFAULT_DRAFT_VOCAB = {"cuda": "full", "cpu": 16384}


def draft_vocab_value(text: str) -> int | str:
    """A --draft-vocab argument: "auto", "full" or a number of tokens (ValueError otherwise)."""
    text = text.strip()
    if text in ("auto", "full"):
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--draft-vocab takes auto, full or a number of tokens, got {text!r}") \
            from None


@dataclass
class EngineConfig:
    target: str = "smollm2-135m"
    draft: str | None = None
    mode: str = "ar"
    tp: int = 1
    # "auto": CUDA where a GPU is visible, else CPU; resolved once, when the config is validated,
    # so every rank (and every later check) sees "cpu" or "cuda"
    device: str = "auto"
    # None: float32 on CPU, bfloat16 on CUDA; "auto" (the command line's default, resolved at
    # init): bfloat16 on CUDA and on a CPU with native bfloat16 arithmetic, else float32
    dtype: str | None = None
    k: int = 5  # draft tokens per round; with adaptive_k the most a round drafts
    # choose each sequence's K (0 .. k) every round from its measured acceptance and the measured
    # costs of a draft step and a verify (ssdlib.speculative.adaptive_k); False: always k
    adaptive_k: bool = True
    fan_out: str = "auto"
    # branches a row of the speculation cache holds under --fan-out auto; None: the device's
    # default (DEFAULT_FAN_OUT_BUDGET), resolved with the device
    fan_out_budget: int | None = None
    # ssd, --fan-out auto: chained builds (the stream placement) take the budget or its halves,
    # the largest whose build the verify hides, by measurement (speculative/fanout_budget.py)
    fan_out_tuning: bool = True
    # the tokens the draft proposes (its LM head scores only those): "full" (the whole
    # vocabulary), N (the N first of the draft's ranking, ssdlib.loading.draft_vocab, plus the
    # end-of-sequence tokens) or "auto" (for a draft that ships a ranking: the N it was trained
    # over, else DEFAULT_DRAFT_VOCAB; "full" for a draft without one); resolved to "full" or N
    draft_vocab: int | str = "auto"
    saguaro_c: float = 1.0
    fallback: str = "auto"
    draft_placement: str = "leader"  # sd only: "leader" (on verifier rank 0) or "separate"
    # ssd only: where the speculator runs. "stream": in the leader's process, on a CUDA stream of
    # its own (one GPU serves both); "rank": its own rank (its own GPU); "auto": stream when the
    # speculator would share a GPU with a verifier rank, rank when a GPU is free; on CPU rank
    # when the host has a core for every rank's threads (distributed.host_cpu)
    speculator_placement: str = "auto"
    max_batch: int = 8
    max_len: int = 2048  # tokens per sequence, prompt + generated
    backend: str | None = None  # default: gloo on CPU, nccl on CUDA
    cuda_graphs: bool = True  # capture the small-query steps on CUDA (no effect on CPU)
    # torch.compile the model's layers inside the captured steps (CUDA only): True, False, or
    # None / "auto" (normalised to None): compile where the steps are captured, the model runs
    # unsharded (TP 1: the draft always) and the expected work amortises the compile
    # (ssdlib.engine.runner.compiled.resolve_compile); "on" / "off" are True / False
    compile: bool | str | None = None
    # where compiled kernels persist (ssdlib.engine.runner.compile_cache); None: $SSDLIB_CACHE_DIR,
    # $XDG_CACHE_HOME/ssdlib or ~/.cache/ssdlib
    cache_dir: str | None = None
    timeout_s: float = 600.0
    # torch intra-op threads per rank; None: OMP_NUM_THREADS if set, else on CPU the cores shared
    # out among the job's ranks on this host (ssdlib.distributed.host_cpu.rank_threads)
    threads: int | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> "EngineConfig":
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for flag, spec in (("--target", self.target), ("--draft", self.draft)):
            if flag == "--draft" and spec is None:  # no draft: the target's default, below
                continue
            if not isinstance(spec, (str, os.PathLike)) or not str(spec).strip():
                raise ConfigError(f"{flag} must be a checkpoint path or a named model, got "
                                  f"{spec!r:.80}")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise ConfigError(f"--tp must be a positive integer, got {self.tp!r}")
        if self.mode in ("sd", "ssd") and not self.draft:
            self.draft = default_draft(self.target)
            if not self.draft:
                raise ConfigError(f"--mode {self.mode} needs a draft model (--draft)")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("--device cuda requested but no CUDA GPU is available")
        if self.fan_out_budget is None:
            self.fan_out_budget = DEFAULT_FAN_OUT_BUDGET[self.device]
        try:
            self.compile = compile_setting(self.compile)
        except ValueError as e:
            raise ConfigError(f"--{e}") from None
        if self.cache_dir is not None and not (isinstance(self.cache_dir, str)
                                               and self.cache_dir.strip()):
            raise ConfigError(f"--cache-dir must be a directory path, got {self.cache_dir!r}")
        if self.dtype not in (None, "auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be auto, float32, bfloat16 or float16, got "
                              f"{self.dtype!r}")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" or native_bf16() else "float32"
        if isinstance(self.k, bool) or not isinstance(self.k, int) or not (1 <= self.k <= 32):
            raise ConfigError(f"--k must be an integer in [1, 32], got {self.k!r}")
        if not isinstance(self.adaptive_k, bool):
            raise ConfigError(f"adaptive_k must be True or False, got {self.adaptive_k!r}")
        if not isinstance(self.fan_out_tuning, bool):
            raise ConfigError(f"fan_out_tuning must be True or False, got "
                              f"{self.fan_out_tuning!r:.80}")
        if isinstance(self.saguaro_c, bool) or not isinstance(self.saguaro_c, (int, float)) \
                or not (0.0 < self.saguaro_c <= 1.0):
            raise ConfigError(f"--saguaro-c must be in (0, 1], got {self.saguaro_c!r}")
        if self.fallback not in FALLBACKS:
            raise ConfigError(f"--fallback must be one of {', '.join(FALLBACKS)}, got {self.fallback!r}")
        if self.draft_placement not in ("leader", "separate"):
            raise ConfigError("--draft-placement must be leader or separate")
        if self.speculator_placement not in PLACEMENTS:
            raise ConfigError(f"--speculator-placement must be one of {', '.join(PLACEMENTS)}, "
                              f"got {self.speculator_placement!r}")
        for name, flag, low in (("max_batch", "--max-batch", 1), ("max_len", "--max-len", 8),
                                ("fan_out_budget", "--fan-out-budget", 1)):
            require_int(flag, getattr(self, name), low)
        if self.threads is not None:
            require_int("--threads", self.threads, 1)
        if not isinstance(self.timeout_s, (int, float)) or not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be a number of seconds > 0, got {self.timeout_s!r}")
        self._check_fan_out()
        self._check_draft_vocab()
        self._check_position_slack()
        self._check_feature_draft()
        return self

    @property
    def feature_draft(self) -> bool:
        """Whether the draft is a feature draft (it reads the target's features: the target
        then keeps them, ``ssdlib.engine.feature_drafter``)."""
        return self.mode in ("sd", "ssd") and is_feature_draft(self.draft)

    def _check_feature_draft(self) -> None:
        """A feature draft runs in sd mode beside the target on its rank (a separate draft rank
        would not have the target's features); in ssd mode its speculator receives them with
        every OUTCOME, in either placement."""
        if self.mode == "sd" and self.draft_placement == "separate" and \
                is_feature_draft(self.draft):
            raise ConfigError(f"--draft {self.draft} is a feature draft: it runs beside the "
                              "target (--draft-placement leader)")

    def _check_draft_vocab(self) -> None:
        """--draft-vocab: "auto" resolved with the device; N needs a draft with a ranking."""
        value = self.draft_vocab
        if value == "auto":
            trained = trained_size(self.draft) if self.mode != "ar" else None
            default = trained or DEFAULT_DRAFT_VOCAB[self.device]
            self.draft_vocab = default if ranking_path(self.draft) is not None else "full"
            return
        if value == "full":
            return
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"--draft-vocab must be auto, full or a number of tokens >= 1, "
                              f"got {value!r:.80}")
        if self.mode != "ar" and ranking_path(self.draft) is None:
            raise ConfigError(f"--draft-vocab {value}: the draft {self.draft!r} has no "
                              f"{DRAFT_VOCAB_FILE} (tools/distill_data.py vocab writes one)")

    def draft_vocab_ids(self, vocab_size: int, eos_ids) -> torch.Tensor | None:
        """The token ids the draft's head scores (sorted), or None for the whole vocabulary."""
        if self.mode == "ar" or self.draft_vocab == "full":
            return None
        return draft_token_ids(self.draft, self.draft_vocab, vocab_size, eos_ids)

    def _check_fan_out(self) -> None:
        """--fan-out is checked in every mode (a typo must not pass silently where it is unused)."""
        try:
            parse_fanout(self.fan_out, self.k)
        except ConfigError as e:
            msg = str(e)
            raise ConfigError(f"--{msg}" if msg.startswith("fan-out") else f"--fan-out: {msg}") \
                from None

    def _check_position_slack(self) -> None:
        """A verification writes k + 1 positions past the committed length, which may reach
        max_len - 1: the model runners allocate POSITION_SLACK positions past max_len for them."""
        if self.mode != "ar" and self.k + 1 > POSITION_SLACK:
            raise ConfigError(f"--k {self.k}: a round writes k + 1 = {self.k + 1} positions past "
                              f"the committed tokens, more than the {POSITION_SLACK} the KV cache "
                              f"keeps past --max-len; use --k {POSITION_SLACK - 1} or less")

    @property
    def torch_dtype_name(self) -> str:
        """The models' dtype (see the field)."""
        return self.dtype or ("bfloat16" if self.device == "cuda" else "float32")

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.torch_dtype_name)

    @property
    def placement(self) -> str:
        """Where the ssd speculator runs, resolved: "stream" or "rank" (see the field)."""
        if self.speculator_placement != "auto":
            return self.speculator_placement
        if self.device == "cuda":
            return "rank" if torch.cuda.device_count() > self.tp else "stream"  # a GPU of its own?
        return cpu_speculator_placement(self.tp, self.threads, available_cores(),
                                        os.environ.get("OMP_NUM_THREADS"))

    def adopt_world_size(self, world_size: int) -> None:
        """Under torchrun the launch decides an "auto" placement: tp ranks = stream, tp + 1 =
        rank."""
        if self.mode == "ssd" and self.speculator_placement == "auto" and \
                world_size in (self.tp, self.tp + 1):
            self.speculator_placement = "stream" if world_size == self.tp else "rank"

    @property
    def world_size(self) -> int:
        """Ranks this configuration needs: tp verifier ranks (+1 speculator rank / separate
        draft)."""
        extra = (self.mode == "ssd" and self.placement == "rank") or \
            (self.mode == "sd" and self.draft_placement == "separate")
        return self.tp + (1 if extra else 0)

    @property
    def dist_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")

    def check_world_size(self, world_size: int) -> None:
        self.adopt_world_size(world_size)
        if world_size != self.world_size:
            extra = " + 1 speculator rank" if self.world_size > self.tp else ""
            raise ConfigError(
                f"world size {world_size} does not fit --tp {self.tp} --mode {self.mode}: "
                f"it needs {self.world_size} ranks ({self.tp} verifier rank(s){extra}); "
                f"use torchrun --nproc_per_node {self.world_size}")
