"""Command-line flags shared by ``ssdlib.generate``, ``ssdlib.chat`` and tools/batch_generate.py,
and how those CLIs report an error (one line on stderr, one exit code per kind of error).

Flag names match ``Generator``'s and ``SamplingParams``' keyword names.
"""

from __future__ import annotations

import argparse
import sys

from ssdlib.engine_config import draft_vocab_value
from ssdlib.errors import RankFailure, SSDError, exit_code
from ssdlib.sampling import SamplingParams


def _draft_vocab_arg(text: str) -> int | str:
    try:
        return draft_vocab_value(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("--draft-vocab ")) from None


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("models and layout")
    g.add_argument("--target", default="smollm2-135m",
                   help="target: HF dir, .gguf file or named default (default: smollm2-135m)")
    g.add_argument("--draft", default=None, help="draft model for --mode sd/ssd")
    g.add_argument("--mode", default="ar", choices=["ar", "sd", "ssd"])
    g.add_argument("--tp", type=int, default=1, help="tensor-parallel verifier ranks")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="'auto' (default): CUDA where a GPU is visible, else CPU")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per rank (default: OMP_NUM_THREADS if set, else "
                        "on CPU the cores but one shared out among the job's ranks on this host)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="'auto' (default): bfloat16 on CUDA and on a CPU with native bfloat16 "
                        "arithmetic (AVX512-BF16 or AMX), else float32")
    g.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    g.add_argument("--max-len", type=int, default=2048, help="context per sequence (tokens)")
    g.add_argument("--compile", nargs="?", const="on", default="auto",
                   choices=["auto", "on", "off"],
                   help="torch.compile each decoder layer inside the captured steps (CUDA): "
                        "'auto' (default) where the expected work amortises the compile (a "
                        "server, many prompts; not one prompt), at TP 1 with CUDA graphs; "
                        "bare --compile = on")
    g.add_argument("--no-compile", dest="compile", action="store_const", const="off",
                   help="same as --compile off")
    g.add_argument("--cache-dir", default=None,
                   help="where compiled kernels persist between starts (default: "
                        "$SSDLIB_CACHE_DIR, $XDG_CACHE_HOME/ssdlib or ~/.cache/ssdlib)")
    g.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run every step eagerly (default on CUDA: decode / verify / draft / tree "
                        "steps replay captured CUDA graphs)")
    s = p.add_argument_group("speculation")
    s.add_argument("--k", type=int, default=5,
                   help="draft tokens per round (the most a round drafts with --adaptive-k)")
    s.add_argument("--adaptive-k", action=argparse.BooleanOptionalAction, default=True,
                   help="choose each sequence's K (0 .. --k) every round from its measured "
                        "acceptance and the measured draft / verify costs; K = 0 decodes like "
                        "ar (default: on)")
    s.add_argument("--fan-out", default="auto",
                   help="'auto' (Thm 12), a list like 8,5,3,2,1,4 (K+1 entries), or all-accepted:N")
    s.add_argument("--fan-out-budget", type=int, default=None,
                   help="cache budget B (branches a row) for --fan-out auto; default 16 on a GPU, "
                        "8 on a CPU")
    s.add_argument("--fan-out-tuning", action=argparse.BooleanOptionalAction, default=True,
                   help="ssd with --fan-out auto, speculator on the GPU's own stream: each build "
                        "takes B, B/2 or B/4 branches, the largest whose build the verify hides, "
                        "by measurement (default: on)")
    s.add_argument("--draft-vocab", type=_draft_vocab_arg, default="auto",
                   help="the tokens the draft proposes (its LM head scores only those): 'full', "
                        "N (the N most frequent of the draft's ranked vocabulary, "
                        "draft_vocab.safetensors) or 'auto' (default: for a draft that ships a "
                        "ranking the N it was trained over, else 16384 on a CPU; otherwise the "
                        "full vocabulary)")
    s.add_argument("--saguaro-c", type=float, default=1.0, help="Saguaro sampling C in (0, 1]")
    s.add_argument("--fallback", default="auto", choices=["auto", "jit", "ngram", "random"])
    s.add_argument("--draft-placement", default="leader", choices=["leader", "separate"])
    s.add_argument("--speculator-placement", default="auto", choices=["auto", "stream", "rank"],
                   help="ssd: 'stream' runs the speculator in the leader's process on a CUDA "
                        "stream of its own (one GPU), 'rank' on its own rank (its own GPU); "
                        "'auto': rank when a GPU is free for it (on a CPU: a core for "
                        "every rank's threads), stream otherwise")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(target=a.target, draft=a.draft, mode=a.mode, tp=a.tp, device=a.device,
                dtype=a.dtype, k=a.k, adaptive_k=a.adaptive_k, fan_out=a.fan_out,
                fan_out_budget=a.fan_out_budget, fan_out_tuning=a.fan_out_tuning,
                draft_vocab=a.draft_vocab,
                saguaro_c=a.saguaro_c, fallback=a.fallback, draft_placement=a.draft_placement,
                speculator_placement=a.speculator_placement,
                max_batch=a.max_batch, max_len=a.max_len, cuda_graphs=a.cuda_graphs,
                compile=a.compile, cache_dir=a.cache_dir,
                threads=a.threads)


def sampling_params(a: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_new_tokens=a.max_new_tokens, temperature=a.temperature,
                          top_p=a.top_p, top_k=a.top_k, seed=a.seed, stop=list(a.stop),
                          ignore_eos=a.ignore_eos)


def report_error(error: BaseException, note: str = "") -> int:
    """Print ``error`` (an SSDError or a KeyboardInterrupt) as one line on stderr and return its
    exit code (:func:`ssdlib.errors.exit_code`); ``note`` is added to an interruption's line."""
    if isinstance(error, KeyboardInterrupt):
        sys.stderr.write("\nssdlib: interrupted" + (f" ({note})" if note else "") + "\n")
        return exit_code(error)
    lines = str(error).strip().splitlines()
    msg = lines[0] if lines else type(error).__name__
    internal = isinstance(error, RankFailure) and error.cause is None
    sys.stderr.write(f"ssdlib {'rank failure' if internal else 'error'}: {msg}\n")
    if internal and len(lines) > 1:
        sys.stderr.write("  (run with --debug for the full traceback)\n")
    return exit_code(error)


def run_reporting(fn, args: argparse.Namespace, note: str = "") -> int:
    """``fn(args)``, with SSDErrors and Ctrl-C reported by :func:`report_error` (``--debug``
    re-raises SSDErrors with their traceback)."""
    try:
        return fn(args)
    except KeyboardInterrupt as e:
        return report_error(e, note)
    except SSDError as e:
        if getattr(args, "debug", False):
            raise
        return report_error(e)
