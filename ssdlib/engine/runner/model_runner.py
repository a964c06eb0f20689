"""One model shard plus its KV cache on one rank, and the forwards the engine needs.

Every forward takes host or device tensors and returns logits in the model's dtype. Forwards
with few queries per row (decode, verify, draft and tree steps) go through :class:`StepGraphs`
(captured CUDA graphs on GPU, the same code eagerly otherwise). Prefills (more than
EXACT_STEP_QUERIES positions a row, a logits index) go through a second :class:`StepGraphs`
where it exists, whose rows are padded to a power-of-two length bucket
(``prefill_bucket``; SDPA attention, the single-row buckets captured when the runner starts):
an eager prefill of SmolLM2's 30 layers cost 15-30 ms of kernel launches on an H200.
``SSDLIB_PREFILL_GRAPHS=0`` runs prefill eagerly.
"""

from __future__ import annotations

import torch

from ssdlib import env
from ssdlib.engine.runner.compiled import checked_step_model, wants_compile
from ssdlib.engine.runner.kv_cache import KVCache
from ssdlib.engine.runner.step_graphs import StepGraphs
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.layers.linear import tp_size_rank
from ssdlib.layers.subset_head import SubsetLMHead
from ssdlib.loading.checkpoint import Checkpoint
from ssdlib.log import get_logger
from ssdlib.models.feature_spec import FeatureSpec
from ssdlib.models.llama import LlamaForCausalLM
from ssdlib.ops.graph_pool import EagerPool, make_graph_pool
from ssdlib.ops.row_top import row_argmax, top_indices
from ssdlib.ops.slot_attention import triton_available

log = get_logger(__name__)

# Positions past max_len that padded rows of a batched forward may write to (never read).
POSITION_SLACK = 64
# Attention key lengths (the SDPA path's copy of each row's keys) are rounded up to this many
# positions, so steps see few distinct shapes (and few captured graphs).
KV_BUCKET = 256
# Forwards with at most this many queries per row are captured (decode, verify, tree steps).
MAX_GRAPH_QUERIES = 64
# Prefills longer than that are padded to a bucket: powers of two from this one up to
# MAX_PREFILL_GRAPH or the cache's length (the last bucket), one captured graph per (batch
# bucket, length bucket). A longer prefill runs as chunks of MAX_PREFILL_GRAPH positions, each
# continuing the cached prefix the ones before it left (ModelRunner._prefill_chunks): one graph
# that long would keep its activations (and SDPA's mask, quadratic in the length) reserved in
# the pool.
FIRST_PREFILL_BUCKET = 128
MAX_PREFILL_GRAPH = 2048
# A single row's prefill from position 0 (a prompt admitted alone, the usual case under
# continuous batching) of a model without a sliding window (its attention then needs no mask)
# has graphs up to this many positions, captured at start: op by op, a
# 2k-token prompt's prefill is bound by its launches (one H200, SD at b = 8 on prompts just past
# 2,048 tokens: a round of 88 ms with 8.6 ms of GPU kernels, profiled; docs/BENCHMARKS.md,
# 2026-12-03), and from position 0 it attends causally with no mask.
MAX_SINGLE_PREFILL_GRAPH = 8192
# A longer forward that reads logits at an index (a short prompt's prefill, the draft's
# catch-up over it) takes the prefill graphs where they exist (ModelRunner.prefill_first);
# otherwise steps capturing every bucket (StepGraphs.all_buckets) pad it to a power of two, so
# that every new prompt length does not capture (and compile) a new shape at admission.
EXACT_STEP_QUERIES = 8
# A draft's catch-up over the tokens it has not seen takes 1 token a round, or 2 after a round
# that accepted every draft (the last draft and the bonus): padded to 2, one step shape serves
# both, and a warm-up that never saw a round accept everything still captured it.
CATCH_UP_QUERIES = 2


def from_position_zero(positions: torch.Tensor) -> bool:
    """Whether host ``positions`` [b, s] are 0 .. s - 1 in every row (a prompt's prefill, which
    attends causally over its own keys: ``AttentionMetadata.from_zero``); False for device
    positions (reading them would wait for the device)."""
    if positions.device.type != "cpu" or positions.shape[1] < 2:
        return False
    return bool((positions == torch.arange(positions.shape[1])).all())


def prefill_bucket(s: int, cap: int) -> int:
    """The padded length of ``s`` positions: the first power of two from FIRST_PREFILL_BUCKET
    that holds them, at most ``cap`` (the last bucket: the prefill graphs' longest, or the
    cache length for a key bucket)."""
    size = FIRST_PREFILL_BUCKET
    while size < s:
        size *= 2
    return min(size, cap)


def use_slot_kernel(device: torch.device) -> bool:
    """The in-place attention kernel serves CUDA steps when it is importable and not disabled
    (SSDLIB_ATTENTION=torch forces the SDPA path)."""
    if device.type != "cuda" or env.choice("SSDLIB_ATTENTION") == "torch":
        return False
    return triton_available()


def eager_step_graphs() -> str:
    """``SSDLIB_STEP_GRAPHS=eager``: a CPU runner takes the GPU's captured-step code path
    (StepGraphs: static input arena, batch buckets and ghost rows, chains, the speculator's
    build steps) with every step run eagerly, once more at its registration as a graph pool's
    warm-up would (``EagerPool(warmup=1)``). ``eager-all``: the same with the compiled steps'
    capture policy (every batch bucket at a step's first use, long indexed forwards padded to
    a power of two), without compiling. For tests: the GPU's code path exercised end to end on
    a CPU. Returns "" (unset), "eager" or "eager-all"."""
    return env.choice("SSDLIB_STEP_GRAPHS")


def captures_steps(device: torch.device | str) -> bool:
    """Whether runners on ``device`` take the captured-step path (CUDA; on CPU
    ``SSDLIB_STEP_GRAPHS``), so that a warm-up has steps to capture."""
    return torch.device(device).type == "cuda" or bool(eager_step_graphs())


class ModelRunner:
    def __init__(self, checkpoint: Checkpoint, tp_group, device: torch.device,
                 dtype: torch.dtype, n_slots: int, max_len: int, tree_len: int = 0,
                 cuda_graphs: bool = False, max_queries: int = MAX_GRAPH_QUERIES,
                 compile: bool | None = None, features: bool | FeatureSpec = False,
                 head_vocab: torch.Tensor | None = None):
        config = checkpoint.config
        self.config = config
        self.device = torch.device(device)
        self.max_len = max_len
        # a prefill from position 0 attends causally over its own keys (AttentionMetadata)
        self.causal_prefill = env.flag("SSDLIB_CAUSAL_PREFILL")
        alloc = max_len + POSITION_SLACK
        # features: every forward also keeps its positions' features (a feature draft's input),
        # those of the spec (True: the last layer's output, before the final norm); checked
        # against the model before its weights load
        spec = FeatureSpec() if features is True else \
            features if isinstance(features, FeatureSpec) else None
        feature_layers = spec.target_layers(config.num_hidden_layers) if spec else ()
        with torch.device(self.device):
            model = LlamaForCausalLM(config, tp_group, max_positions=alloc)
        for p in model.parameters():
            p.data = p.data.to(dtype)
        model.load_weights(checkpoint.weights)
        if head_vocab is not None:  # a draft's vocabulary: its head scores those tokens only
            model.lm_head = SubsetLMHead.of(model.lm_head, head_vocab)
        self.model = model.eval().requires_grad_(False)
        # one extra slot: the scratch slot that padded (ghost) rows of a captured step write to
        self.cache = KVCache(config.num_hidden_layers, n_slots + 1, model.kv_heads_local, alloc,
                             config.head_dim, dtype, device, tree_len,
                             features_dim=spec.width(config.hidden_size) if spec else 0,
                             feature_layers=feature_layers)
        self.scratch_slot = n_slots
        self.use_kernel = use_slot_kernel(self.device)
        # the model as the captured steps run it: torch.compile'd (fusing the small kernels
        # inside each graph) with compile=True on CUDA
        self.step_model = self.model
        if wants_compile(compile, self.device, cuda_graphs, tp_size_rank(tp_group)[0]):
            self.step_model = checked_step_model(self.model, self.cache, self.scratch_slot,
                                                 self.use_kernel)
        self.graphs: StepGraphs | None = None
        self.prefill_graphs: StepGraphs | None = None
        eager_path = eager_step_graphs()
        if self.device.type == "cuda" or eager_path:
            # TP > 1: every rank captures the same steps in the same order (followers get the
            # leader's inputs on the host, TPChannel.serve), the collectives inside them too
            pool = (make_graph_pool(self.device, enabled=cuda_graphs)
                    if self.device.type == "cuda" else EagerPool(warmup=1))
            # on CUDA every batch bucket up to n_slots' at a step's first use, compiled or not:
            # the warm-up (Generator.warm_up) then captures (and compiles) them all before the
            # first timed prompt, and a batch shrinking to a smaller bucket mid-run finds its
            # graph. n_slots is the capture plan (the CLI asks for no more slots than prompts)
            self.graphs = StepGraphs(self, pool, n_slots, max_queries, tree_len,
                                     all_buckets=(self.device.type == "cuda"
                                                  or eager_path == "eager-all"))
            if (cuda_graphs and self.device.type == "cuda"
                    and env.flag("SSDLIB_PREFILL_GRAPHS")):
                # one row from position 0 attends causally, with no mask, unless a window
                # bands it: only then do its graphs go past MAX_PREFILL_GRAPH
                # (a prompt fills at most max_len positions: no longer bucket past the cap)
                maskless = self.causal_prefill and config.sliding_window is None
                longest = min(max_len, MAX_SINGLE_PREFILL_GRAPH) \
                    if maskless and max_len > MAX_PREFILL_GRAPH else min(alloc, MAX_PREFILL_GRAPH)
                # the plain model: a prefill runs once a request and its kernels are long,
                # while compiling each length bucket (compile=True) cost minutes at start-up
                self.prefill_graphs = StepGraphs(self, pool, n_slots, longest, 0,
                                                 kind="prefill", use_kernel=False,
                                                 model=self.model)
                self._capture_prefill(longest)
            log.info("model runner: %s graphs, attention %s", pool.kind,
                     "slot kernel" if self.use_kernel else "sdpa")

    @torch.inference_mode()
    def _capture_prefill(self, longest: int) -> None:
        """Capture the single-row prefill buckets up to ``longest`` now (a row admitted alone,
        the usual case under continuous batching, then finds its graph; more rows capture on
        first use)."""
        s = FIRST_PREFILL_BUCKET
        while True:
            s = min(s, longest)
            self.forward(torch.zeros(1, s, dtype=torch.int64), torch.arange(s).view(1, -1),
                         torch.tensor([self.scratch_slot]), torch.tensor([[s - 1]]))
            if s >= longest:
                break
            s *= 2

    def release_graphs(self) -> None:
        """Drop the captured steps (after the device is idle). Before the process group is
        destroyed: a graph that captured NCCL collectives holds on to the communicator, and
        destroying it under a live graph hangs (TP 2 on two H200s)."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None:
                graphs.pool.clear()  # one shared pool: the second clear finds it empty

    def kv_bucket(self, kv_len: int) -> int:
        """Static key length for a step whose queries see at most ``kv_len`` slot keys."""
        if self.use_kernel:
            return self.cache.max_len  # the kernel reads only up to each limit
        return min(-(-kv_len // KV_BUCKET) * KV_BUCKET, self.cache.max_len)

    @staticmethod
    def _slot_start(slots: torch.Tensor) -> int | None:
        """First slot when host-side ``slots`` are consecutive (attention then reads views of
        the cache instead of gathering a copy; matters on CPU)."""
        if slots.device.type != "cpu":
            return None
        first = int(slots[0])
        return first if slots.tolist() == list(range(first, first + len(slots))) else None

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                logits_index: torch.Tensor | None = None, kv_len: int | None = None) -> torch.Tensor:
        """input_ids/positions: [b, s]; slots: [b]; logits_index [b, n] -> logits [b, s or n, V]
        in the model's dtype. Causal: a query at position p sees keys <= p. ``kv_len`` (> every
        position) is read from ``positions`` when they are on the host; give it for device
        positions (otherwise it costs a host sync)."""
        b, s = input_ids.shape
        if self.prefill_first(input_ids, positions, logits_index):
            return self._prefill_step(input_ids, positions, slots, logits_index)
        input_ids, positions = self.step_queries(input_ids, positions, logits_index)
        if kv_len is None or positions.shape[1] > s:
            kv_len = max(kv_len or 0, int(positions.max()) + 1)
        kv_len = self.kv_bucket(kv_len)
        if self.graphs is not None and self.graphs.fits(b, s):
            return self.graphs.forward(input_ids, positions, slots, positions + 1, logits_index,
                                       kv_len)
        if self._prefill_fits(input_ids, positions, logits_index):
            return self._prefill_step(input_ids, positions, slots, logits_index)
        chunks = self._prefill_chunks(input_ids, positions, logits_index)
        if chunks:
            return self._chunked_prefill(input_ids, positions, slots, logits_index, chunks)
        dev = self.device
        from_zero = self.causal_prefill and from_position_zero(positions)
        positions = positions.to(dev)
        meta = AttentionMetadata(positions, slots.to(dev), kv_len, kv_limit=positions + 1,
                                 slot_start=self._slot_start(slots), from_zero=from_zero)
        index = None if logits_index is None else logits_index.to(dev)
        return self.model(input_ids.to(dev), self.cache, meta, index)

    def step_queries(self, ids: torch.Tensor, positions: torch.Tensor,
                     logits_index: torch.Tensor | None,
                     catch_up: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, positions) for a forward: as given, or, where it fits a captured step that
        captures every bucket, padded: a forward of more than EXACT_STEP_QUERIES host queries a
        row with a logits index to the next power of two (at most the graphs' queries), a
        draft's ``catch_up`` of fewer than CATCH_UP_QUERIES to that many. The padding
        continues each row's positions (``pack_rows``' layout, as a prefill bucket's): its KV
        lands past the row's length, never read before it is overwritten (the draft's next
        token writes there), and the logits index still points at real tokens."""
        b, s = ids.shape
        g = self.graphs
        if (g is None or not g.all_buckets or not g.fits(b, s) or logits_index is None
                or ids.device.type != "cpu" or positions.device.type != "cpu"):
            return ids, positions
        if s > EXACT_STEP_QUERIES:
            size = min(1 << (s - 1).bit_length(), g.max_queries)
        elif catch_up and s < CATCH_UP_QUERIES:
            size = CATCH_UP_QUERIES
        else:
            return ids, positions
        if size <= s or int(positions[:, 0].max()) + size > self.cache.max_len:
            return ids, positions
        padded = positions[:, :1] + torch.arange(size).view(1, -1)
        if not torch.equal(padded[:, :s], positions):  # not consecutive positions per row
            return ids, positions
        return torch.nn.functional.pad(ids, (0, size - s)), padded

    def prefill_first(self, ids: torch.Tensor, positions: torch.Tensor,
                      logits_index: torch.Tensor | None) -> bool:
        """Whether a forward of more than EXACT_STEP_QUERIES queries a row with a logits index
        (a prompt's prefill, a draft's catch-up over it) takes a prefill graph, which it does
        where one fits rather than a step graph: its query count follows the prompt's length,
        and each new count would be a step shape to capture (and, compiled, to compile) in the
        middle of a run, which no warm-up can foresee. The prefill graphs (plain model) have
        few length buckets, the single-row ones captured when the runner starts."""
        return ids.shape[1] > EXACT_STEP_QUERIES and \
            self._prefill_fits(ids, positions, logits_index)

    def _prefill_fits(self, ids, positions, logits_index) -> bool:
        """A prefill (host inputs, logits of chosen rows) that a prefill graph can run: up to
        MAX_PREFILL_GRAPH positions, or MAX_SINGLE_PREFILL_GRAPH for one row from position 0."""
        g = self.prefill_graphs
        if not (g is not None and logits_index is not None and positions.device.type == "cpu"
                and ids.device.type == "cpu" and g.fits(*ids.shape)):
            return False
        size = prefill_bucket(ids.shape[1], g.max_queries)
        if size > MAX_PREFILL_GRAPH and not (ids.shape[0] == 1 and from_position_zero(positions)):
            return False
        return int(positions[:, 0].max()) + size <= self.cache.max_len

    def _prefill_chunks(self, ids, positions, logits_index) -> list[tuple[int, int]]:
        """The column ranges [c, e) of MAX_PREFILL_GRAPH positions that a prefill too long for
        one prefill graph runs as, one prefill graph each, when every chunk fits one; [] when
        not (the prefill then runs eagerly). It needs each row's positions consecutive
        (``pack_rows``' layout): a chunk continues the cached prefix the chunks before it left.
        Op by op, a long prefill of a small model is bound by its launches: a windowed draft's
        prompt (its mask keeps it off the single-row graphs), several rows admitted at once, or
        one row continuing a cached prefix."""
        s = ids.shape[1]
        if (self.prefill_graphs is None or logits_index is None or s <= MAX_PREFILL_GRAPH
                or positions.device.type != "cpu" or ids.device.type != "cpu"):
            return []
        if not torch.equal(positions, positions[:, :1] + torch.arange(s).view(1, -1)):
            return []
        chunks = [(c, min(c + MAX_PREFILL_GRAPH, s)) for c in range(0, s, MAX_PREFILL_GRAPH)]
        last = torch.zeros_like(logits_index)  # a chunk's logits index: fits needs one
        if all(self._prefill_fits(ids[:, c:e], positions[:, c:e], last) for c, e in chunks):
            return chunks
        return []

    def _chunked_prefill(self, ids, positions, slots, logits_index,
                         chunks: list[tuple[int, int]]) -> torch.Tensor:
        """The prefill as consecutive prefill graphs over ``chunks`` (``_prefill_chunks``):
        each writes its positions' KV, which the chunks after it read as a cached prefix. Each
        row's logits at ``logits_index`` [b, n] come from the chunk holding that index (the
        others' are read at a clamped index and discarded) -> [b, n, V]."""
        out = None
        for c, e in chunks:
            logits = self._prefill_step(ids[:, c:e], positions[:, c:e], slots,
                                        (logits_index - c).clamp(0, e - c - 1))
            inside = ((logits_index >= c) & (logits_index < e)).to(logits.device)
            # a new tensor each chunk: a graph's output is overwritten by its next replay
            out = logits.clone() if out is None else torch.where(inside[..., None], logits, out)
        return out

    def _prefill_step(self, ids, positions, slots, logits_index) -> torch.Tensor:
        """The prefill padded to its length bucket: row i's positions are start_i + 0, 1, ...
        (``pack_rows``' layout), the padding continues them (its KV lands past the row's
        length, never read before it is overwritten). Keys: a bucket too, past the last
        position (a prefill from position 0 reads exactly its own bucket)."""
        b, s = ids.shape
        size = prefill_bucket(s, self.prefill_graphs.max_queries)
        ids = torch.nn.functional.pad(ids, (0, size - s))
        positions = positions[:, :1] + torch.arange(size).view(1, -1)
        kv_len = prefill_bucket(int(positions[:, -1].max()) + 1, self.cache.max_len)
        return self.prefill_graphs.forward(ids, positions, slots, positions + 1, logits_index,
                                           kv_len)

    @torch.inference_mode()
    def greedy_chain(self, first: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     steps: int, vocab: int) -> torch.Tensor:
        """Greedy decoding of ``steps`` tokens per row with no host in between (one captured
        graph on GPU): first [b] token ids (device) at positions [b] (host) -> the next
        ``steps`` tokens [b, steps], argmax over the first ``vocab`` logits."""
        kv_len = self.kv_bucket(int(positions.max()) + steps)
        b = first.shape[0]
        if self.graphs is not None and self.graphs.fits(b, 1):
            return self.graphs.chain(first, positions, slots, steps, vocab, kv_len)
        return self.chain_body(first.to(self.device), positions.to(self.device),
                               slots.to(self.device), steps, vocab, kv_len, False)

    @torch.inference_mode()
    def prefix_chain(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     logits_index: torch.Tensor, steps: int, vocab: int) -> torch.Tensor:
        """The draft's greedy proposal in one graph on GPU: a forward over ``ids`` [b, s] at
        ``positions`` [b, s] (host; the tokens the draft has not seen yet), the argmax over the
        first ``vocab`` logits at ``logits_index`` [b, 1] (each row's last real token), then
        ``steps`` greedy steps from the position after it -> tokens [b, 1 + steps].

        Unseen tokens that fit no step graph (a new sequence's whole prompt: SD's draft KV
        starts empty) take :meth:`forward` (a captured prefill where one fits) and then
        :meth:`greedy_chain`: run as one eager chain they cost ~12 ms a sequence on an H200
        (inferred from the increase measured at 7560c73: SD's draft phase 1.16 -> 1.32 ms a
        round over 289 rounds and 4 sequences at b = 1)."""
        b, s = ids.shape
        prefill = self.prefill_first(ids, positions, logits_index)
        ids, positions = self.step_queries(ids, positions, logits_index, catch_up=True)
        kv_len = self.kv_bucket(int(positions.max()) + steps + 1)
        if self.graphs is not None and self.graphs.fits(b, s) and not prefill:
            return self.graphs.prefix_chain(ids, positions, slots, logits_index, steps, vocab,
                                            kv_len)
        first = row_argmax(self.forward(ids, positions, slots, logits_index)[:, 0, :vocab])
        if steps == 0:
            return first.view(-1, 1)
        after = positions.gather(1, logits_index)[:, 0] + 1  # host: the first draft's position
        rest = self.greedy_chain(first, after, slots, steps, vocab)
        return torch.cat([first.view(-1, 1), rest], dim=1)

    def prefix_chain_body(self, ids, positions, slots, index, steps: int, vocab: int,
                          kv_len: int, use_kernel: bool) -> torch.Tensor:
        """``prefix_chain`` on device tensors (the captured body)."""
        meta = AttentionMetadata(positions, slots, kv_len, kv_limit=positions + 1,
                                 use_kernel=use_kernel)
        first = row_argmax(self.step_model(ids, self.cache, meta, index)[:, 0, :vocab])  # [b]
        if steps == 0:
            return first.view(-1, 1)
        after = positions.gather(1, index)[:, 0] + 1  # the first drafted token's position
        rest = self.chain_body(first, after, slots, steps, vocab, kv_len, use_kernel)
        return torch.cat([first.view(-1, 1), rest], dim=1)

    def chain_body(self, tok, positions, slots, steps: int, vocab: int, kv_len: int,
                   use_kernel: bool) -> torch.Tensor:
        """tok/positions/slots [b] on the device -> [b, steps] (the captured chain's body)."""
        out = []
        for j in range(steps):
            pos = (positions + j).view(-1, 1)
            meta = AttentionMetadata(pos, slots, kv_len, kv_limit=pos + 1, use_kernel=use_kernel)
            tok = row_argmax(self.step_model(tok.view(-1, 1), self.cache, meta)[:, 0, :vocab])
            out.append(tok)
        return torch.stack(out, dim=1)

    @property
    def compiles(self) -> bool:
        """Whether the captured steps run a torch.compile'd model (``compile``; CUDA)."""
        return self.step_model is not self.model

    def speculation_step(self, last, spec, n, slots, kv_len: int) -> torch.Tensor:
        """A chained round's forward (both sides: the target's verify, the draft's candidates;
        device tensors, inside a captured step): the last committed token ``last`` [b] and the
        speculation ``spec`` [b, K] at positions n - 1 .. n + K - 1 (``n`` [b] committed
        tokens, all but the last already in the slot's KV) -> logits [b, K + 1, V]."""
        ids = torch.cat([last.view(-1, 1), spec], dim=1)                       # [b, K+1]
        pos = (n - 1).view(-1, 1) + torch.arange(spec.shape[1] + 1, device=n.device)
        meta = AttentionMetadata(pos, slots, kv_len, kv_limit=pos + 1, use_kernel=self.use_kernel)
        return self.step_model(ids, self.cache, meta)

    def tree_body(self, tok, kv_limit, full_mask, slots, depth: int, top: int, vocab: int,
                  kv_len: int, use_kernel: bool, pick=None):
        """All ``depth`` tree-decode steps of the branches (the body of the speculator's
        captured build, ``tree_build.py``), on device tensors. tok [b, B]: each branch's first
        token; kv_limit [b, B]: its slot prefix; full_mask [b, B*depth, B*depth]
        (``tree_mask_full`` without speculation keys); ``pick(d, logits [b, B, vocab])`` -> the
        next token of every branch [b, B] (default: the argmax, taken from the top-``top``
        candidates: no second pass over the vocabulary). ``top`` = 0 keeps no candidates (a
        chained build, which computes them again: one argmax per depth instead of a top-k).
        Returns (tokens [b, B, depth], top-``top`` candidates after each token
        [b, B, depth, top], or None for ``top`` = 0)."""
        b, B = tok.shape
        lane = torch.arange(B, device=tok.device).expand(b, B)
        tokens, tops = [], []
        for d in range(depth):
            meta = AttentionMetadata(kv_limit + d, slots, kv_len, kv_limit=kv_limit,
                                     tree_index=lane + d * B,
                                     tree_mask=full_mask[:, d * B:(d + 1) * B, :B * (d + 1)],
                                     tree_len=B * (d + 1), use_kernel=use_kernel)
            logits = self.step_model(tok, self.cache, meta)[..., :vocab]  # [b, B, vocab]
            if top:
                tops.append(top_indices(logits, top))  # sorted: [..., 0] is a maximum
                tok = tops[-1][..., 0] if pick is None else pick(d, logits)
            else:
                tok = row_argmax(logits) if pick is None else pick(d, logits)
            tokens.append(tok)
        return torch.stack(tokens, dim=2), torch.stack(tops, dim=2) if top else None

    @torch.inference_mode()
    def tree_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                     tree_index: torch.Tensor, kv_limit: torch.Tensor, tree_mask: torch.Tensor,
                     kv_len: int) -> torch.Tensor:
        """One tree-decode step: input_ids/positions/tree_index/kv_limit [b, s] (s = branches),
        tree_mask [b, s, T] -> logits [b, s, V]. Query (i, j) sees slot keys [0, kv_limit[i, j])
        and the branch keys tree_mask[i, j] allows; its own K/V goes to tree_index[i, j]."""
        kv_len = self.kv_bucket(kv_len)
        b, s = input_ids.shape
        tree_len = tree_mask.shape[-1]
        if self.graphs is not None and self.graphs.fits(b, s, tree_len):
            return self.graphs.forward(input_ids, positions, slots, kv_limit, None, kv_len,
                                       tree_index, tree_mask, tree_len)
        dev = self.device
        meta = AttentionMetadata(positions.to(dev), slots.to(dev), kv_len,
                                 kv_limit=kv_limit.to(dev), tree_index=tree_index.to(dev),
                                 tree_mask=tree_mask.to(dev), tree_len=tree_len,
                                 slot_start=self._slot_start(slots))
        return self.model(input_ids.to(dev), self.cache, meta)
