"""Where a draft disagrees with its target: agreement by the target's own confidence.

On each held-out set (the chat set and HumanEval, as ``tools/distill/evaluate.py``), the
target's greedy answers are made once; then, at every answer position, the target's top-1
probability p_max, whether the draft's argmax is the target's (greedy agreement, the per-token
greedy acceptance) and sum min(p, q) (the sampled acceptance at T = 1) are read from one
cache-free forward of each model over prompt + answer. Positions are bucketed by p_max: a set
whose answers have many low-confidence positions bounds any small draft's greedy agreement,
since there the target's argmax is close to a coin toss among near-equals.

    python -m tools.distill.confidence --draft DIR [--draft DIR2 ...] [--target smollm2-135m]
        [--humaneval HumanEval.jsonl.gz] [--n-prompts 24] [--max-new-tokens 128] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

BUCKETS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0000001)  # p_max edges
MAX_POSITIONS = 4096  # prompt + answer


def greedy_answers(target: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from ssdlib import Generator, SamplingParams

    with Generator(target, mode="ar", device="cpu", dtype="float32") as gen:
        outs = gen.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens))
    return [o.token_ids for o in outs]


def build(ck) -> torch.nn.Module:
    from ssdlib.models.llama import LlamaForCausalLM

    m = LlamaForCausalLM(ck.config, None, MAX_POSITIONS)
    m.load_weights(ck.weights)
    return m.eval()


def answer_probs(model, prompt: list[int], answer: list[int]) -> torch.Tensor:
    """The model's next-token distributions at the answer's positions: [len(answer), V]."""
    ids = torch.tensor([prompt + answer])
    return model.forward_full(ids)[0, len(prompt) - 1:-1].float().softmax(-1)


def bucket_table(p_max: torch.Tensor, agree: torch.Tensor, accept: torch.Tensor) -> list[dict]:
    rows = []
    for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:]):
        m = (p_max >= lo) & (p_max < hi)
        n = int(m.sum())
        rows.append({"p_max": [lo, min(hi, 1.0)], "positions": n,
                     "share": n / max(1, p_max.numel()),
                     "agreement": float(agree[m].mean()) if n else None,
                     "acceptance": float(accept[m].mean()) if n else None})
    return rows


@torch.no_grad()
def run(target: str, drafts: list[str], humaneval: str | None, n_prompts: int,
        max_new_tokens: int) -> dict:
    from ssdlib.loading import load_checkpoint
    from ssdlib.loading.draft import load_draft
    from ssdlib.prompts import PromptEncoder
    from tools.distill.evaluate import prompt_sets

    ck = load_checkpoint(target)
    encoder = PromptEncoder(ck.tokenizer, ck.config.vocab_size, MAX_POSITIONS)
    t_model = build(ck)
    d_models = {path: build(load_draft(path, ck)) for path in drafts}
    result = {"target": target, "sets": {}}
    for name, prompts in prompt_sets(humaneval, n_prompts).items():
        ids = [encoder.encode(p, chat=True) for p in prompts]
        answers = greedy_answers(target, ids, max_new_tokens)
        p_max, agree, accept = [], {d: [] for d in drafts}, {d: [] for d in drafts}
        for prompt, answer in zip(ids, answers):
            if not answer:
                continue
            t = answer_probs(t_model, prompt, answer)  # the target's, once for all drafts
            top, t_arg = t.max(-1)
            p_max.append(top)
            for path, d_model in d_models.items():
                d = answer_probs(d_model, prompt, answer)
                agree[path].append((d.argmax(-1) == t_arg).float())
                accept[path].append(torch.minimum(t, d).sum(-1))
        p_max = torch.cat(p_max)
        per_draft = {}
        for path in drafts:
            a, c = torch.cat(agree[path]), torch.cat(accept[path])
            per_draft[path] = {"agreement": float(a.mean()), "acceptance": float(c.mean()),
                               "buckets": bucket_table(p_max, a, c)}
        result["sets"][name] = {"prompts": len(prompts), "positions": int(p_max.numel()),
                                "mean_p_max": float(p_max.mean()), "drafts": per_draft}
    return result


def print_result(r: dict) -> None:
    for name, s in r["sets"].items():
        print(f"{name}: {s['prompts']} prompts, {s['positions']} answer positions, "
              f"target mean p_max {s['mean_p_max']:.3f}")
        for path, d in s["drafts"].items():
            print(f"  {path}: greedy agreement {d['agreement']:.3f}, "
                  f"sum min(p, q) {d['acceptance']:.3f}")
            print("  | target p_max | share of positions | agreement | sum min(p, q) |")
            print("  |---|---|---|---|")
            for b in d["buckets"]:
                ag = "" if b["agreement"] is None else f"{b['agreement']:.3f}"
                ac = "" if b["acceptance"] is None else f"{b['acceptance']:.3f}"
                print(f"  | {b['p_max'][0]:.1f}-{b['p_max'][1]:.1f} | {b['share']:.3f} | "
                      f"{ag} | {ac} |")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--draft", action="append", required=True, help="a draft (repeat)")
    p.add_argument("--humaneval", default=None, help="HumanEval.jsonl.gz (default: the package)")
    p.add_argument("--n-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", default=None)
    return p


def main(argv: list[str] | None = None) -> dict:
    a = build_parser().parse_args(argv)
    r = run(a.target, a.draft, a.humaneval, a.n_prompts, a.max_new_tokens)
    print_result(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(r, f, indent=2)
    return r


if __name__ == "__main__":
    main()
