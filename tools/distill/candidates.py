"""Draft candidates (dev/gpu_draft.sh): their measured SD acceptance and step cost, the
speedup these predict, and the packed checkpoint directories.

Prediction (the standard SD model, acceptances independent with probability ``a`` per draft
token): a round of K draft steps and one target verify yields (1 - a^(K+1)) / (1 - a) tokens on
average and costs K * c + 1 target steps, where c = draft step / target step (one CUDA-graph
replay each, b = 1, bf16: .stage/floor_probe.py). The predicted speedup over plain decoding is
their ratio at the best K in 1..8. It overrates cheap drafts: in the engine (compiled steps) a
round's draft phase was measured as ~0.3 ms fixed plus ~0.43 of the probe's step per draft
step (one H200, SmolLM2; docs/BENCHMARKS.md, 2026-12-01), so a 2-layer draft predicted level with a 6-layer
one ran 0.88x it. Compare finalists in the engine (``dev/gpu_quick.sh`` ``chat1`` / ``cands``).

    python -m tools.distill.candidates evaluate --target T --draft DIR --out rows.json ...
    python -m tools.distill.candidates probe --probe .stage/floor_probe.py --out probe.json \
        --model NAME=DIR ...
    python -m tools.distill.candidates report --out draft_candidates.json --evals DIR \
        --probe-json probe.json --cand NAME=DIR ...
    python -m tools.distill.candidates pack --dir DIR --out cand.tar --target T
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import re
import sys
import tarfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

KS = tuple(range(1, 9))
# Step shapes: (layers, hidden, ffn, q heads, kv heads, head_dim, vocab)
TARGET_SHAPE = (30, 576, 1536, 9, 3, 64, 49152)  # SmolLM2-135M
CURRENT_DRAFT_SHAPE = (6, 128, 512, 4, 2, 32, 49152)  # smollm2-135m-draft before it was widened
MAX_TAR_BYTES = 16 * 2**20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json")
SHARED_TOKENIZER_FILE = "tokenizer_source.json"


def expected_tokens(a: float, k: int) -> float:
    """Tokens per SD round: accepted draft tokens plus the target's own, (1 - a^(K+1))/(1 - a)."""
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def speedup(a: float, c: float, k: int) -> float:
    """Tokens per round over the round's cost in target steps (K draft steps + one verify)."""
    return expected_tokens(a, k) / (k * c + 1.0)


def best_k(a: float, c: float, ks=KS) -> tuple[int, float]:
    """(K, speedup) at the K in ``ks`` that predicts the largest speedup."""
    return max(((k, speedup(a, c, k)) for k in ks), key=lambda kv: kv[1])


def shape_of(config: dict) -> tuple[int, ...]:
    """The step shape of an HF Llama config.json."""
    hq = config["num_attention_heads"]
    hd = config.get("head_dim") or config["hidden_size"] // hq
    return (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"], hq,
            config.get("num_key_value_heads") or hq, hd, config["vocab_size"])


def read_config(directory: str) -> dict:
    with open(os.path.join(directory, "config.json")) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- measurement (GPU)

def load_probe(path: str):
    """floor_probe.py at ``path`` as a module; SystemExit naming the path when it is missing."""
    if not os.path.isfile(path):
        raise SystemExit(f"--probe {path}: no such file (the floor probe, floor_probe.py)")
    spec = importlib.util.spec_from_file_location("floor_probe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def parse_bench_line(text: str) -> dict:
    """floor_probe.bench's printed line -> {"eager_ms", "graph_ms"}."""
    eager = re.search(r"eager\s+([\d.]+)\s*ms", text)
    graph = re.search(r"graph\s+([\d.]+)\s*ms", text)
    if not (eager and graph):
        raise ValueError(f"no timings in the probe's output: {text!r}")
    return {"eager_ms": float(eager.group(1)), "graph_ms": float(graph.group(1))}


def probe_step(probe, name: str, shape, repeats: int = 3) -> dict:
    """One decode step (b = 1, bf16) of ``shape``, eager and as one CUDA-graph replay: the best
    of ``repeats`` runs of floor_probe.bench."""
    best = None
    for _ in range(repeats):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            probe.bench(name, *shape)
        r = parse_bench_line(buf.getvalue())
        print(buf.getvalue().rstrip(), flush=True)
        best = r if best is None or r["graph_ms"] < best["graph_ms"] else best
    return {**best, "shape": list(shape)}


# ----------------------------------------------------------------------------- report

def cost_ratio(probe: dict, name: str, key: str = "graph_ms") -> float | None:
    if name not in probe or "target" not in probe:
        return None
    return probe[name][key] / probe["target"][key]


def candidate_rows(name: str, evals: list[dict], c: float | None) -> list[dict]:
    """Per (set, temperature): a_p and the predicted speedup at the best K."""
    rows = []
    for e in evals:
        row = {"candidate": name, "set": e["set"], "temperature": e["temperature"],
               "a_p": e["a_p"], "mean_accepted": e.get("mean_accepted"), "c": c}
        if c is not None:
            k, s = best_k(e["a_p"], c)
            row.update(best_k=k, speedup=s, speedup_k5=speedup(e["a_p"], c, 5))
        rows.append(row)
    return rows


def table(results: dict) -> str:
    """A markdown table: one line per candidate, a_p and predicted speedup (best K) per
    (set, temperature)."""
    keys = []
    for r in results.values():
        for e in r.get("rows", []):
            if (e["set"], e["temperature"]) not in keys:
                keys.append((e["set"], e["temperature"]))
    head = ["candidate", "MB", "step ms", "c"] + [f"{s} T={t:g}: a_p / speedup (K)"
                                                  for s, t in keys]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, r in results.items():
        by = {(e["set"], e["temperature"]): e for e in r.get("rows", [])}
        mb = r.get("safetensors_bytes")
        cells = [name, f"{mb / 1e6:.2f}" if mb else "-",
                 f"{r['step_ms']:.3f}" if r.get("step_ms") is not None else "-",
                 f"{r['c']:.3f}" if r.get("c") is not None else "-"]
        for key in keys:
            e = by.get(key)
            if e is None:
                cells.append("-")
            elif e.get("speedup") is None:
                cells.append(f"{e['a_p']:.3f} / -")
            else:
                cells.append(f"{e['a_p']:.3f} / {e['speedup']:.2f} ({e['best_k']})")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_report(cands: dict[str, str], evals_dir: str, probe: dict,
                 extra: dict | None = None) -> dict:
    """{name: {...}} from the candidates' dirs, their evaluation JSONs (evals_dir/NAME.json)
    and the probe's timings ({name: {"graph_ms", ...}}, "target" among them)."""
    results = {}
    for name, directory in cands.items():
        r: dict = {"dir": directory}
        try:
            cfg = read_config(directory)
            r["shape"] = list(shape_of(cfg))
        except (OSError, ValueError, KeyError) as e:
            r["error"] = f"no usable config.json: {e}"
        weights = os.path.join(directory, "model.safetensors")
        if os.path.exists(weights):
            r["safetensors_bytes"] = os.path.getsize(weights)
        dj = os.path.join(directory, "distill.json")
        if os.path.exists(dj):
            with open(dj) as f:
                d = json.load(f)
            last = (d.get("history") or [{}])[-1]
            r["train"] = {"step": d.get("step"), "seconds": d.get("seconds"),
                          "held_out_kl": last.get("kl"), "agreement": last.get("agreement"),
                          "acceptance": last.get("acceptance"),
                          "loss": d.get("args", {}).get("loss"),
                          "params": d.get("draft", {}).get("params")}
        ev_path = os.path.join(evals_dir, f"{name}.json")
        evals = []
        if os.path.exists(ev_path):
            with open(ev_path) as f:
                evals = json.load(f)
        else:
            r.setdefault("error", "no evaluation")
        if name in probe:
            r["step_ms"] = probe[name]["graph_ms"]
            r["step_eager_ms"] = probe[name].get("eager_ms")
        r["c"] = cost_ratio(probe, name)
        r["rows"] = candidate_rows(name, evals, r["c"])
        r.update((extra or {}).get(name, {}))
        results[name] = r
    return results


# ----------------------------------------------------------------------------- packing

def shared_tokenizer_ref(same_as: str, target: str | None) -> dict:
    """tokenizer_source.json's content: the target's name and its tokenizer's fingerprint."""
    from ssdlib.loading import load_checkpoint

    tok = load_checkpoint(target or same_as).tokenizer
    if tok is None:
        raise ValueError(f"{target or same_as} has no tokenizer")
    return {"same_as": same_as, "fingerprint": tok.fingerprint()}


def pack(directory: str, out: str, same_as: str = "smollm2-135m", target: str | None = None,
         max_bytes: int = MAX_TAR_BYTES, with_tokenizer: bool = False) -> dict:
    """``directory`` as a flat tar laid out like ssdlib/assets/smollm2-135m-draft: every regular
    file except the tokenizer's (unless ``with_tokenizer``) and the training state, plus
    tokenizer_source.json naming the target's tokenizer (kept when the dir has one). Extract
    with ``tar -xf OUT -C ssdlib/assets/NEW_NAME``. Raises when the tar exceeds ``max_bytes``."""
    skip = set() if with_tokenizer else set(TOKENIZER_FILES)
    names = sorted(f for f in os.listdir(directory)
                   if os.path.isfile(os.path.join(directory, f)) and f not in skip
                   and not f.endswith((".pt", ".tmp")))
    ref_path = os.path.join(directory, SHARED_TOKENIZER_FILE)
    ref = None
    if not with_tokenizer and not os.path.exists(ref_path):
        ref = json.dumps(shared_tokenizer_ref(same_as, target), indent=1).encode()
    tmp = out + ".tmp"
    with tarfile.open(tmp, "w") as tar:
        for f in names:
            tar.add(os.path.join(directory, f), arcname=f)
        if ref is not None:
            info = tarfile.TarInfo(SHARED_TOKENIZER_FILE)
            info.size, info.mode, info.mtime = len(ref), 0o644, int(time.time())
            tar.addfile(info, io.BytesIO(ref))
            names.append(SHARED_TOKENIZER_FILE)
    size = os.path.getsize(tmp)
    if size > max_bytes:
        os.remove(tmp)
        raise ValueError(f"{out}: {size / 2**20:.2f} MiB > {max_bytes / 2**20:.2f} MiB "
                         f"({', '.join(names)})")
    os.replace(tmp, out)
    return {"tar": out, "bytes": size, "files": sorted(names)}


# ----------------------------------------------------------------------------- CLI

def _pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for it in items or []:
        name, _, path = it.partition("=")
        if not path:
            raise SystemExit(f"expected NAME=DIR, got {it!r}")
        out[name] = path
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("evaluate", help="tools/distill/evaluate.py's rows as JSON")
    e.add_argument("--target", required=True)
    e.add_argument("--draft", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--humaneval", default=None)
    e.add_argument("--n-prompts", type=int, default=None)
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--k", type=int, default=5)
    e.add_argument("--device", default="cuda")
    e.add_argument("--dtype", default=None)
    e.add_argument("--card", default=None)
    e.add_argument("--lengths", default="", help="as tools.distill.evaluate's --lengths")
    e.add_argument("--length-prompts", type=int, default=None)
    pr = sub.add_parser("probe", help="decode step times (floor probe, one graph replay)")
    pr.add_argument("--probe", required=True, help="path of floor_probe.py")
    pr.add_argument("--out", required=True)
    pr.add_argument("--model", action="append", help="NAME=DIR (its config.json's shape)")
    pr.add_argument("--repeats", type=int, default=3)
    r = sub.add_parser("report", help="table and JSON of all results")
    r.add_argument("--out", required=True)
    r.add_argument("--evals", required=True, help="folder of NAME.json evaluation rows")
    r.add_argument("--probe-json", required=True)
    r.add_argument("--cand", action="append", help="NAME=DIR")
    r.add_argument("--extra", default=None, help="JSON {NAME: {...}} merged into the results")
    k = sub.add_parser("pack", help="a candidate dir as a tar like the shipped draft asset")
    k.add_argument("--dir", required=True)
    k.add_argument("--out", required=True)
    k.add_argument("--same-as", default="smollm2-135m")
    k.add_argument("--target", default=None, help="where the tokenizer is read (default same-as)")
    k.add_argument("--with-tokenizer", action="store_true")
    return p


def _subcommand(p: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` (its errors print that subcommand's usage)."""
    sub = next(x for x in p._actions if isinstance(x, argparse._SubParsersAction))
    return sub.choices[name]


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    a = p.parse_args(argv)

    if a.cmd == "evaluate":
        from tools.distill import evaluate

        e = _subcommand(p, "evaluate")
        rows = evaluate.run(a.target, a.draft, a.humaneval, a.n_prompts, a.k, a.max_new_tokens,
                            a.device, a.dtype, a.card,
                            lengths=evaluate.parse_lengths(e, a.lengths),
                            length_n=evaluate.parse_lengths_n(e, a.length_prompts))
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)
    elif a.cmd == "probe":
        probe = load_probe(a.probe)
        shapes = {"target": TARGET_SHAPE, "current-draft": CURRENT_DRAFT_SHAPE}
        results: dict = {}
        for name, directory in _pairs(a.model).items():
            try:
                shapes[name] = shape_of(read_config(directory))
            except (OSError, ValueError, KeyError) as ex:
                results[name] = {"error": str(ex)}
        for name, shape in shapes.items():
            try:
                results[name] = probe_step(probe, name, shape, a.repeats)
            except Exception as ex:  # noqa: BLE001 - one failure must not stop the others
                results[name] = {"error": f"{type(ex).__name__}: {ex}", "shape": list(shape)}
                print(f"probe {name}: {results[name]['error']}", flush=True)
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)
    elif a.cmd == "report":
        with open(a.probe_json) as f:
            probe = {n: v for n, v in json.load(f).items() if "graph_ms" in v}
        extra = None
        if a.extra and os.path.exists(a.extra):
            with open(a.extra) as f:
                extra = json.load(f)
        results = build_report(_pairs(a.cand), a.evals, probe, extra)
        out = {"formula": "speedup = (1 - a^(K+1)) / (1 - a) / (K * c + 1), best K in 1..8; "
                          "c = draft / target graph-replay step (b=1, bf16)",
               "probe": probe, "candidates": results}
        with open(a.out, "w") as f:
            json.dump(out, f, indent=2)
        print(table(results))
    elif a.cmd == "pack":
        try:
            info = pack(a.dir, a.out, a.same_as, a.target, with_tokenizer=a.with_tokenizer)
        except ValueError as ex:  # over the size limit: a probe draft, not an asset
            raise SystemExit(f"not packed: {ex}") from None
        print(json.dumps(info))


if __name__ == "__main__":
    main()
