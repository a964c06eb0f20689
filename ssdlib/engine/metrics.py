"""Per-output metrics of speculative modes (names shared with the CLI's JSON)."""

from __future__ import annotations


def record_acceptance(seqs, outcome: VerifyOutcome, k: int) -> None:
    mask = outcome.accepted_mask.tolist()
    for q, accepted_row in zip(seqs, mask):
        m = q.metrics
        m["rounds"] += 1
        m["drafted"] = m.get("drafted", 0) + k
        m["accepted"] = m.get("accepted", 0) + sum(accepted_row)
        pos = m.setdefault("accepted_by_pos", [0] * k)
        for i, a in enumerate(accepted_row):
            pos[i] += int(a)


def finalize_acceptance_metrics(m: dict) -> None:
    """Derived per-output metrics: acceptance rate a_p, mean accepted length per round."""
    if m.get("drafted"):
        m["acceptance_rate"] = m["accepted"] / m["drafted"]
        m["mean_accepted"] = m["accepted"] / m["rounds"]
        m["tokens_per_round"] = (m["accepted"] + m["rounds"]) / m["rounds"]
        m["acceptance_by_pos"] = [a / m["rounds"] for a in m["accepted_by_pos"]]
