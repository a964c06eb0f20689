"""The transport between leader and speculator: :class:`SpecLink` sends and receives the
messages that ``protocol.py`` defines (their layouts live there, once, for both sides).

Point-to-point send/recv on the two-rank ``spec_group``; tensors on the rank's device (NCCL on
GPU, gloo on CPU; ``staged``: gloo through host memory for ranks that share a GPU). Host-side
buffers are pinned on GPU and reused: each waits for its last copy to the device before it is
written again.

Sends are ``dist.send``: on GPU the sending stream waits for the transfer's end, so the next
step launched on it (the leader's verify after an OUTCOME) starts only then. ``isend`` with the
buffers' reuse tracked was measured slower (two H200s, b = 1 greedy: SSD 776.8 vs 925.2 tok/s).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ssdlib.distributed.protocol import (Admit, CacheRows, ControlFrame, FeatureRows, Header,
                                         Op, Outcome, Speculation, SpeculatorStats)


class SpecLink:
    """The transport: sends and receives protocol.py's messages between leader and
    speculator."""

    # a speculator rank's failure ends the job through the launcher, never through the link
    # (the in-process LocalLink keeps its speculator's error here)
    failed: BaseException | None = None
    overlap = None  # the build's overlap with the verify is measured in process only

    def __init__(self, group, peer: int, device: torch.device, max_batch: int, k: int,
                 vocab_size: int, staged: bool = False, branches: int = 0,
                 features: tuple[int, torch.dtype] | None = None):
        self.group, self.peer, self.device = group, peer, device
        # a feature draft's speculator: every OUTCOME carries the target's features (their
        # width and dtype; protocol.FeatureRows)
        self.features = features
        self.staged = staged  # a gloo link between ranks on one GPU: tensors travel via the host
        self.k, self.vocab_size, self.max_batch = k, vocab_size, max_batch
        pin = torch.device(device).type == "cuda"
        self.branches = branches  # the speculation cache's branches per row (0: no cache)
        size = ControlFrame.size(max_batch, k)
        self.frame = torch.zeros(size, dtype=torch.int64, device=device)
        self.frame_host = torch.zeros(size, dtype=torch.int64, pin_memory=pin)
        self._frame_in: torch.Tensor | None = None  # the last received frame, on the host
        self.spec_buf = torch.zeros(max_batch, k + 1, dtype=torch.int64, device=device)
        self.spec_host = torch.zeros(max_batch, k + 1, dtype=torch.int64, pin_memory=pin)
        self.cache_buf = torch.zeros(max_batch, CacheRows.width(branches, k), dtype=torch.int64,
                                     device=device)
        self._q_buf: torch.Tensor | None = None  # allocated on the first sampling batch
        self._cache_recv = None  # (rows, work, host buffer or None) of a posted CACHE receive
        # the host buffers' last copy to the device, waited for before they are written again
        self._copied = torch.cuda.Event() if pin else None
        # a SPEC's q held back by ``send_spec(..., hold_q=True)`` until ``send_held_q``: on GPU
        # it then leaves from a side stream once q is in its buffer (``_q_ready``), not after
        # the work queued since (NCCL orders a send after the calling stream's work); the
        # buffer is written again only after that send (``_q_sent``)
        self._held_q: torch.Tensor | None = None
        gpu_side = pin and not staged
        self._side = torch.cuda.Stream(device=device) if gpu_side else None
        self._q_ready = torch.cuda.Event() if gpu_side else None
        self._q_sent = torch.cuda.Event() if gpu_side else None

    def _send(self, t: torch.Tensor) -> None:
        dist.send(t.cpu() if self.staged else t.contiguous(), dst=self.peer, group=self.group)

    def _recv_staged(self, t: torch.Tensor) -> torch.Tensor:
        """A staged link's receive: a host tensor shaped like ``t``."""
        host = torch.empty(t.shape, dtype=t.dtype)
        dist.recv(host, src=self.peer, group=self.group)
        return host

    def _recv(self, t: torch.Tensor) -> torch.Tensor:
        if self.staged:
            return t.copy_(self._recv_staged(t))
        dist.recv(t, src=self.peer, group=self.group)
        return t

    def _recv_to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Receive into ``t`` (the device buffer) and return the message on the host; a staged
        link receives on the host and skips the device."""
        return self._recv_staged(t) if self.staged else self._recv(t).cpu()

    def _host_buffer(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` (a pinned buffer), once its last copy to the device is done."""
        if self._copied is not None:
            self._copied.synchronize()
        return host

    def _send_host(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        """Send ``host`` through its device twin ``dev`` (same shape): one copy, one send."""
        if self.staged:
            dist.send(host.clone(), dst=self.peer, group=self.group)
            return
        dev.copy_(host, non_blocking=self._copied is not None)
        if self._copied is not None:
            self._copied.record()
        self._send(dev)

    def q_buf(self) -> torch.Tensor:
        if self._q_buf is None:
            self._q_buf = torch.zeros(self.max_batch, self.k, self.vocab_size,
                                      dtype=torch.float32, device=self.device)
        return self._q_buf

    def _feature_wire_dtype(self) -> torch.dtype:
        """The features' dtype on the wire: the target's, float32 through the host (a staged
        gloo link, whose reduced-precision support is not relied on)."""
        return torch.float32 if self.staged else self.features[1]

    def _send_frame(self, header: Header, outcome: Outcome | None = None) -> None:
        ControlFrame.pack(self._host_buffer(self.frame_host), header, outcome)
        self._send_host(self.frame_host, self.frame)

    # -- leader side ------------------------------------------------------------------------
    def send_admit(self, msg: Admit) -> None:
        self._send_frame(msg.header())
        for part in msg.pack():
            self._send(part.to(self.device))

    def send_outcome(self, msg: Outcome) -> None:
        if len(msg.slots) > self.max_batch:
            raise ValueError(f"OUTCOME of {len(msg.slots)} rows > max_batch {self.max_batch}")
        self._send_frame(msg.header(), msg)
        if self.features is not None:
            if msg.features is None:
                raise ValueError("an OUTCOME to a feature draft's speculator needs its features")
            self._send(msg.features.pack_spans().to(self.device))
            self._send(msg.features.values.to(self._feature_wire_dtype()).contiguous())

    def recv_spec_tokens(self, b: int) -> Speculation:
        """A SPEC's tokens part, read back here (one copy; q, if due, follows: ``recv_q``)."""
        return Speculation.unpack(self._recv_to_host(self.spec_buf[:b]), None)

    def recv_q(self, b: int) -> torch.Tensor:
        """A SPEC's q part [b, K, V] on the device (a copy: the buffer is reused)."""
        return self._recv(self.q_buf()[:b]).clone()

    def post_cache(self, b: int) -> None:
        """Post the receive of the next CACHE (``b`` rows) without waiting for it: its host
        cost overlaps what runs meanwhile; :meth:`recv_cache` completes it."""
        if self._cache_recv is not None:
            raise RuntimeError("a CACHE receive is already posted")
        buf = torch.empty(self.cache_buf[:b].shape, dtype=torch.int64) if self.staged \
            else self.cache_buf[:b]
        self._cache_recv = (b, dist.irecv(buf, src=self.peer, group=self.group), buf)

    def recv_cache(self, b: int) -> CacheRows:
        """The CACHE pushed after the build for the last OUTCOME's ``b`` rows (one read-back),
        through the receive :meth:`post_cache` posted if there is one."""
        if self._cache_recv is None:
            host = self._recv_to_host(self.cache_buf[:b])
        else:
            posted, work, buf = self._cache_recv
            self._cache_recv = None
            if posted != b:
                raise RuntimeError(f"CACHE receive posted for {posted} rows, taken for {b}")
            work.wait()
            host = buf if self.staged else buf.cpu()
        return CacheRows.unpack(host, self.branches, self.k)

    def recv_stats(self) -> SpeculatorStats:
        buf = torch.zeros(SpeculatorStats.SIZE, dtype=torch.float64, device=self.device)
        return SpeculatorStats.unpack(self._recv(buf))

    def send_shutdown(self) -> None:
        self._send_frame(Header(Op.SHUTDOWN))

    # -- speculator side --------------------------------------------------------------------
    def recv_header(self) -> Header:
        """Receive a frame (one read-back) and return its header; an OUTCOME's rows are in
        hand with it (``recv_outcome``)."""
        self._frame_in = self._recv_to_host(self.frame)
        return ControlFrame.unpack(self._frame_in, self.k)[0]

    def recv_admit(self, header: Header) -> Admit:
        parts = [self._recv_to_host(t) for t in Admit.empty(header, self.device)]
        return Admit.unpack(*parts)

    def recv_outcome(self, header: Header) -> Outcome:
        """The OUTCOME whose ``header`` was just received (its rows came in the same frame)."""
        if self._frame_in is None:
            raise RuntimeError("recv_outcome before recv_header: the rows come with the frame")
        rows = ControlFrame.unpack(self._frame_in, self.k)[1][:header.b]
        outcome = Outcome.unpack(rows, header, self.k)
        if self.features is not None:
            width, dtype = self.features
            spans = self._recv_to_host(torch.zeros(FeatureRows.spans_size(header.b),
                                                   dtype=torch.int64, device=self.device))
            values = torch.empty(FeatureRows.values_shape(spans, width),
                                 dtype=self._feature_wire_dtype(), device=self.device)
            outcome.features = FeatureRows.unpack(spans, self._recv(values).to(dtype))
        return outcome

    def send_spec(self, spec: Speculation, tokens: bool = True, hold_q: bool = False) -> None:
        """The tokens part (when ``tokens``; tokens and kinds may be host tensors: packed on the
        host, one copy), then q (a device tensor) when the speculation has one; ``hold_q``: q is
        copied into its buffer now and sent by :meth:`send_held_q` (after the cache build is
        launched, so that its send does not delay the build)."""
        if self._held_q is not None:
            raise RuntimeError("a SPEC's q is still held: send_held_q first")
        b = spec.tokens.shape[0]
        q_out = self.q_buf() if spec.q is not None else None
        if q_out is not None and self._q_sent is not None:
            torch.cuda.current_stream(self.device).wait_event(self._q_sent)  # the last q left
        parts = spec.pack(self._host_buffer(self.spec_host), q_out)
        if tokens:
            self._send_host(parts[0], self.spec_buf[:b])
        if len(parts) > 1:
            if hold_q:
                self._held_q = parts[1]
                if self._q_ready is not None:
                    self._q_ready.record()
            else:
                self._send(parts[1])

    def send_held_q(self) -> None:
        """Send the q that :meth:`send_spec` held back, if any (on GPU from the side stream,
        which waits only for q's copy into its buffer)."""
        q, self._held_q = self._held_q, None
        if q is None:
            return
        if self._side is None:
            self._send(q)
            return
        with torch.cuda.stream(self._side):
            self._side.wait_event(self._q_ready)
            self._send(q)
            self._q_sent.record()

    def send_cache(self, rows: torch.Tensor) -> None:
        """CACHE: ``rows`` (int64 [b, width], :meth:`CacheRows.pack_device`) as built, on the
        device: no read-back here."""
        self._send(rows)

    def send_stats(self, stats: SpeculatorStats) -> None:
        self._send(stats.pack().to(self.device))
