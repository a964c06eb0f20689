"""Per-output metrics of speculative modes (names shared with the CLI's JSON)."""

from __future__ import annotations

from ssdlib.speculative.acceptance import QKind

# The kind of a chained round's miss that verified placeholder tokens (no speculation:
# engine/leader/chained_rounds.py), beside the QKinds of the fallbacks.
PLACEHOLDER = -1
FALLBACK_NAMES = {int(QKind.DENSE): "jit", int(QKind.ONEHOT): "ngram", int(QKind.UNIFORM): "random",
                  PLACEHOLDER: "none"}


def record_acceptance(seqs, result, limits: list[int], k_max: int,
                      alphas: list[float] | None = None) -> None:
    """result: the round's :class:`~ssdlib.engine.leader.verify.RoundResult` (host lists);
    limits: each row's K this round (its drafts verified, 0 .. k_max); alphas: each row's
    acceptance estimate after the round (adaptive K), when there is one."""
    for i, (q, accepted_row, k) in enumerate(zip(seqs, result.accepted_mask, limits)):
        m = q.metrics
        m["rounds"] += 1
        n_acc = sum(accepted_row)
        m["drafted"] = m.get("drafted", 0) + k
        m["accepted"] = m.get("accepted", 0) + n_acc
        # a token is tried only if every token before it was accepted
        m["tried"] = m.get("tried", 0) + n_acc + (1 if n_acc < k else 0)
        pos = m.setdefault("accepted_by_pos", [0] * k_max)
        for j, a in enumerate(accepted_row):
            pos[j] += int(a)
        m["k_sum"] = m.get("k_sum", 0) + k
        m["k0_rounds"] = m.get("k0_rounds", 0) + (k == 0)
        runs = m.setdefault("k_runs", [])  # the K of each round, as [K, rounds in a row]
        if runs and runs[-1][0] == k:
            runs[-1][1] += 1
        else:
            runs.append([k, 1])
        if alphas is not None:
            m["k_alpha"] = alphas[i]


def finalize_acceptance_metrics(m: dict) -> None:
    """Derived per-output metrics: acceptance rate a_p, mean accepted length per round, the
    mean K chosen (``mean_k``; ``k0_rounds`` rounds at K = 0, ``k_runs`` the K of every round
    as runs of [K, rounds], ``k_alpha`` the last acceptance estimate they were chosen on); SSD's
    hit rates and idle fractions."""
    finalize_ssd_metrics(m)
    if "k_sum" in m and m["rounds"]:
        m["mean_k"] = m.pop("k_sum") / m["rounds"]  # the K chosen, per round
    if m.get("drafted"):
        # a_p: per-token acceptance (accepted / tried), the paper's definition
        m["acceptance_rate"] = m["accepted"] / m["tried"] if m["tried"] else 0.0
        m["mean_accepted"] = m["accepted"] / m["rounds"]
        m["tokens_per_round"] = (m["accepted"] + m["rounds"]) / m["rounds"]
        m["acceptance_by_pos"] = [a / m["rounds"] for a in m["accepted_by_pos"]]


def record_lookup(m: dict, k: int, hit: bool, kind: int) -> None:
    """SSD: the speculation answering outcome k came from the cache (hit) or a fallback."""
    m["lookups"] = m.get("lookups", 0) + 1
    m["hits"] = m.get("hits", 0) + int(hit)
    by_k = m.setdefault("lookups_by_k", {})
    entry = by_k.setdefault(str(k), [0, 0])
    entry[0] += 1
    entry[1] += int(hit)
    if not hit:
        fb = m.setdefault("fallbacks", {})
        name = speculation_source(hit, kind)
        fb[name] = fb.get(name, 0) + 1


def speculation_source(hit: bool, kind: int) -> str:
    """Where an SSD speculation came from: the cache, or the fallback that answered the miss."""
    return "cache" if hit else FALLBACK_NAMES.get(kind, "other")


def record_source(m: dict, source: str, accepted: int) -> None:
    """SSD: a round verified a speculation from ``source``; ``accepted`` of its tokens held.
    ``accepted_by_source[source]`` = [rounds, accepted tokens]."""
    entry = m.setdefault("accepted_by_source", {}).setdefault(source, [0, 0])
    entry[0] += 1
    entry[1] += accepted


def mean_accepted_by_source(outputs_metrics) -> dict[str, dict[str, float]]:
    """Over outputs' metrics: {source: {"rounds", "mean_accepted"}}, sources sorted."""
    total: dict[str, list[int]] = {}
    for m in outputs_metrics:
        for source, (rounds, accepted) in m.get("accepted_by_source", {}).items():
            t = total.setdefault(source, [0, 0])
            t[0] += rounds
            t[1] += accepted
    return {s: {"rounds": r, "mean_accepted": a / r if r else 0.0}
            for s, (r, a) in sorted(total.items())}


def k_totals(outputs_metrics) -> dict:
    """Over outputs' metrics: ``mean_k`` (the K chosen, per round, rounds weighted as
    ``rounds`` is) and ``k0_rounds`` (rounds at K = 0, summed); {} without speculation."""
    rounds = k_sum = k0 = 0
    for m in outputs_metrics:
        if "mean_k" in m:
            rounds += m["rounds"]
            k_sum += m["mean_k"] * m["rounds"]
            k0 += m.get("k0_rounds", 0)
    return {"mean_k": k_sum / rounds, "k0_rounds": k0} if rounds else {}


def finalize_ssd_metrics(m: dict) -> None:
    if m.get("lookups"):
        m["hit_rate"] = m["hits"] / m["lookups"]
        m["hit_rate_by_k"] = {k: h / n for k, (n, h) in sorted(m["lookups_by_k"].items()) if n}
    if "wait_s" in m:
        busy = m.get("verify_s", 0.0)
        m["verifier_idle_frac"] = m["wait_s"] / (m["wait_s"] + busy) if m["wait_s"] + busy else 0.0
