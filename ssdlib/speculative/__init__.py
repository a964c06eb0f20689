"""Speculative-decoding math: exact verification, Saguaro sampling, fan-out, fallback policy,
cheap backup speculators. Pure functions on tensors and numbers; no model or device state."""

from ssdlib.speculative.acceptance import (DraftQ, QKind, VerifyOutcome, verify_greedy,
                                           verify_sampled)
from ssdlib.speculative.fallback import (batch_hit_rate, choose_fallback, critical_batch_size,
                                         expected_speedup, expected_tokens, fallback_speedups,
                                         steady_hit_rate)
from ssdlib.speculative.fanout import (FanoutEstimator, geometric_fanout, geometric_fanout_real,
                                       parse_fanout)
from ssdlib.speculative.ngram import ngram_or_random, propose_ngram, propose_random
from ssdlib.speculative.rng import sample_token
from ssdlib.speculative.saguaro import sample_saguaro, saguaro_q

__all__ = [
    "DraftQ", "QKind", "VerifyOutcome", "verify_greedy", "verify_sampled",
    "batch_hit_rate", "choose_fallback", "critical_batch_size", "expected_speedup",
    "expected_tokens", "fallback_speedups", "steady_hit_rate",
    "FanoutEstimator", "geometric_fanout", "geometric_fanout_real", "parse_fanout",
    "ngram_or_random", "propose_ngram", "propose_random",
    "sample_token", "sample_saguaro", "saguaro_q",
]
