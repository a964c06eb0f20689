"""Leader -> TP followers: each step's command as two small tensors broadcast on the TP group.

Layout (int64): header [5] = (op, b, s, n, kv_len) where n is logits positions per row (0 = all)
and kv_len > every position (so followers pick the same captured step without reading the
payload back); payload [b*s ids | b*s positions | b slots | b*n logits_index]. No pickling.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

OP_FORWARD = 1
OP_SHUTDOWN = 2


class TPChannel:
    def __init__(self, tp_group, device: torch.device):
        self.group = tp_group
        self.device = device
        self.header = torch.zeros(5, dtype=torch.int64, device=device)

    def _bcast(self, t: torch.Tensor) -> None:
        dist.broadcast(t, src=0, group=self.group)

    def send_forward(self, ids, positions, slots, logits_index, kv_len: int) -> None:
        b, s = ids.shape
        n = 0 if logits_index is None else logits_index.shape[1]
        self.header.copy_(torch.tensor([OP_FORWARD, b, s, n, kv_len]))
        self._bcast(self.header)
        parts = [ids.reshape(-1), positions.reshape(-1), slots.reshape(-1)]
        if logits_index is not None:
            parts.append(logits_index.reshape(-1))
        self._bcast(torch.cat([p.to(self.device, torch.int64) for p in parts]))

    def send_shutdown(self) -> None:
        self.header.copy_(torch.tensor([OP_SHUTDOWN, 0, 0, 0, 0]))
        self._bcast(self.header)

    def serve(self, runner) -> None:
        """Follower loop: run every forward the leader announces until shutdown."""
        while True:
            self._bcast(self.header)
            op, b, s, n, kv_len = self.header.tolist()
            if op == OP_SHUTDOWN:
                return
            payload = torch.empty(2 * b * s + b + b * n, dtype=torch.int64, device=self.device)
            self._bcast(payload)
            # back on the host, as the leader holds them: the runner then takes the leader's
            # path (captured step, captured prefill bucket or eager) and so issues the same
            # collectives; a graph capture on one rank only would hang both
            ids, pos, slots, rest = payload.cpu().split([b * s, b * s, b, b * n])
            index = rest.view(b, n) if n else None
            runner.forward(ids.view(b, s), pos.view(b, s), slots, index, kv_len)


class TargetExecutor:
    """What the leader calls to run the (possibly tensor-parallel) target: one forward on all
    TP ranks, logits on the leader."""

    def __init__(self, runner, channel: TPChannel | None):
        self.runner = runner
        self.channel = channel

    def forward(self, ids, positions, slots, logits_index=None,
                kv_len: int | None = None) -> torch.Tensor:
        """ids/positions [b, s], slots [b], logits_index [b, n] on the host -> logits.
        ``kv_len`` (> every position) is needed for device positions (reading them back
        would wait for the device)."""
        if kv_len is None:
            kv_len = int(positions.max()) + 1
        if self.channel is not None:
            self.channel.send_forward(ids, positions, slots, logits_index, kv_len)
        return self.runner.forward(ids, positions, slots, logits_index, kv_len)

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.send_shutdown()
