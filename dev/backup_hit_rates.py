"""The miss model's predicted hit rate after each backup against the measured one.

For each backup in turn (``--fallback random|ngram|jit`` forced), SSD with the speculator in this
process (stream placement) generates from the prompts; at the end of the run the speculator's
estimates are read: each backup's measured hit rate after its speculations
(``Fallbacks.after``), its per-token acceptance, and what ``FanoutEstimator.hit_rate_after``
predicts for it. Prints one JSON line a backup.

    python dev/backup_hit_rates.py --prompts-file chat24.jsonl --n-prompts 24 --device cpu
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ssdlib import Generator, SamplingParams  # noqa: E402
from ssdlib.engine.speculator.speculator import CacheRole  # noqa: E402
from tools.bench import encode_prompts, file_prompts  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="smollm2-135m")
    p.add_argument("--prompts-file", required=True)
    p.add_argument("--n-prompts", type=int, default=24)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--backups", default="random,ngram,jit")
    args = p.parse_args()
    prompts = encode_prompts(args.target, file_prompts(args.prompts_file, args.n_prompts), True)
    roles: list[CacheRole] = []
    real_init = CacheRole.__init__

    def keep(self, *a, **kw):
        real_init(self, *a, **kw)
        roles.append(self)
    CacheRole.__init__ = keep
    for backup in args.backups.split(","):
        roles.clear()
        with Generator(target=args.target, mode="ssd", fallback=backup, device=args.device,
                       speculator_placement="stream") as g:
            for ids in prompts:
                g.generate([ids], SamplingParams(max_new_tokens=args.max_new_tokens))
            role = roles[-1]
            fb, est = role.fallbacks, role.estimator
            a = {"jit": fb.jit_acceptance(est.a_p), "ngram": fb.ngram_acceptance(),
                 "random": 0.0}[backup]
            lookups, hits = fb.after[backup]
            cache_lookups, cache_hits = fb.after["cache"]
            print(json.dumps({
                "backup": backup, "acceptance": round(a, 3),
                "measured_after": round(hits / max(lookups, 1), 3), "lookups": lookups,
                "predicted_after": round(est.hit_rate_after(a, own=backup == "jit"), 3),
                "predicted_pooled": round(_pooled(est, a), 3),
                "cache_measured_after": round(cache_hits / max(cache_lookups, 1), 3),
                "cache_predicted_after": round(est.hit_rate_after(est.a_p), 3),
                "a_p": round(est.a_p, 3)}), flush=True)
    return 0


def _pooled(est, a: float) -> float:
    """The prediction without the lookups' kinds (every lookup pooled, as before the kinds)."""
    kinds, est.kind_lookups = est.kind_lookups, {True: {}, False: {}}
    try:
        return est.hit_rate_after(a)
    finally:
        est.kind_lookups = kinds


if __name__ == "__main__":
    raise SystemExit(main())
