"""The speculator's mirror of one sequence of the batch (by KV slot)."""

from __future__ import annotations

import torch

from ssdlib.distributed.protocol import AdmitRow
from ssdlib.sampling import SamplingParams
from ssdlib.speculative.acceptance import QKind
from ssdlib.speculative.rng import RowStream

# Salt that separates the speculator's random streams from the verifier's for the same seed.
SPEC_STREAM = 7_777_777


class SpecRow:
    """Committed tokens, how far the draft KV in the slot is valid, and the speculation in flight."""

    def __init__(self, slot: int, tokens: list[int], params: SamplingParams, index: int,
                 device: torch.device):
        self.slot = slot
        self.tokens = tokens  # committed
        self.params = params
        self.stream = RowStream.from_seed(params.seed, SPEC_STREAM + index)  # device draws
        self.valid = 0  # leading committed tokens whose draft KV in the slot is correct
        self.sent: list[int] | None = None  # the speculation in flight
        self.fed = False  # the speculation's tokens are in the slot (cache was built)
        self.reuse: int | None = None  # cache branch that answered the last outcome (a hit)
        self.kind = int(QKind.DENSE)
        # where the speculation in flight came from: "cache", "jit" (the draft's, now), "ngram"
        # or "random" (drawn by the leader for a miss, with the backup the speculator named)
        self.source = "jit"
        self.limit: int | None = None  # how many of its tokens the leader verifies (None: all)

    @property
    def is_jit(self) -> bool:
        """The speculation in flight is this speculator's jit draft (not the cache's, not a
        fallback's)."""
        return self.source == "jit"

    @classmethod
    def admitted(cls, row: AdmitRow, device: torch.device) -> "SpecRow":
        return cls(row.slot, row.tokens, row.params, row.request_index, device)

    def commit(self, k: int, bonus: int) -> bool:
        """Commit outcome (k, t*): s_1..s_k of the speculation in flight + t*. Returns whether
        there was one (False on a sequence's first outcome, which only carries t*)."""
        n = len(self.tokens)
        if self.sent is None:
            self.tokens.append(bonus)
            return False
        self.tokens += self.sent[:k] + [bonus]
        if self.fed:  # s_1..s_k are in the slot's draft KV
            self.valid = n + k
        return True

    def restart(self, tokens: list[int]) -> None:
        """Nothing in flight; ``tokens`` committed (the draft KV valid for all of them), as
        after an admission: the next outcome commits the token after them."""
        self.tokens = tokens
        self.valid = len(tokens)
        self.sent = None
        self.fed = False
        self.reuse = None
        self.kind = int(QKind.DENSE)
        self.source = "jit"
        self.limit = None
