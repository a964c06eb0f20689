"""On the rounds whose speculation came from the cache: how many tokens the cache's speculation
kept against what the leader's n-gram proposal (``speculative.ngram.propose_ngram``) would have
kept there, by the length n of the suffix the proposal matched (3, 2, 1; none). Greedy: a
proposal keeps the tokens it shares with the committed outcome, up to the first that differs or
the end of the verified ones. Tells whether an n-gram proposal of a long match should replace a
cache hit's speculation.

    SSDLIB_CHAINED_ROUNDS=0 python dev/ngram_vs_cache.py --prompts-file chat24.jsonl
    SSDLIB_CHAINED_ROUNDS=0 python dev/ngram_vs_cache.py --humaneval HumanEval.jsonl.gz
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssdlib import Generator, SamplingParams  # noqa: E402
from ssdlib.engine.speculator.speculator import CacheRole  # noqa: E402
from ssdlib.speculative.ngram import kept_prefix, propose_ngram  # noqa: E402
from tools.bench import encode_prompts, file_prompts, humaneval_prompts  # noqa: E402


def matched_order(tokens: list[int], K: int) -> tuple[int, list[int] | None]:
    """(n of the longest suffix that recurs, the proposal) as ``propose_ngram`` finds them."""
    for n in (3, 2, 1):
        proposal = propose_ngram(tokens, K, max_ngram=n, min_ngram=n)
        if proposal is not None:
            return n, proposal
    return 0, None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts-file")
    p.add_argument("--humaneval")
    p.add_argument("--n-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--dtype", default="auto")
    args = p.parse_args()
    prompts = (file_prompts(args.prompts_file, args.n_prompts) if args.prompts_file
               else humaneval_prompts(args.humaneval, args.n_prompts))
    ids = encode_prompts(args.target, prompts, True)
    seen: list[tuple[int, int, list[int]]] = []  # (k, limit, committed tokens) of cache rows
    real = CacheRole.observe

    def observe(self, row, k, limit):
        if row.source == "cache":
            seen.append((k, limit, list(row.tokens)))
        return real(self, row, k, limit)
    CacheRole.observe = observe
    with Generator(target=args.target, mode="ssd", k=args.k, device="cpu", dtype=args.dtype,
                   speculator_placement="stream", adaptive_k=False) as g:
        for prompt in ids:
            g.generate([prompt], SamplingParams(max_new_tokens=args.max_new_tokens))
    by_n: dict[int, list[int]] = {}  # n -> [rounds, cache kept, n-gram kept]
    for k, limit, tokens in seen:
        start = len(tokens) - k - 1
        known = tokens[start:start + min(k + 1, limit)]
        n, proposal = matched_order(tokens[:start], limit)
        kept = kept_prefix(proposal, known)
        row = by_n.setdefault(n, [0, 0, 0])
        row[0] += 1
        row[1] += k
        row[2] += kept
    for n in sorted(by_n, reverse=True):
        rounds, cache, ngram = by_n[n]
        print(json.dumps({"match": n, "rounds": rounds, "cache_kept": round(cache / rounds, 3),
                          "ngram_kept": round(ngram / rounds, 3)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
