"""The step model under torch.compile (regional compilation of the decoder layers).

Inside the captured graphs each decoder layer runs compiled: inductor fuses its small kernels
(norms, rotary, activation, residuals) around the matrix products and the attention kernel, an
opaque custom op (``ssdlib::slot_attention``). The layers share one code object and take their
weights as inputs, so one compile per step shape serves all of them, where compiling the whole
model traced every layer again for every step shape (minutes at start-up).
"""

from __future__ import annotations

import torch

from ssdlib import env
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.log import get_logger
from ssdlib.ops.slot_attention import triton_available

log = get_logger(__name__)

# torch.compile specialisations kept for the decoder layer's code (step shapes; dynamo's default
# is 8)
COMPILE_RECOMPILE_LIMIT = 256


def compile_step_model(model, backend: str = "inductor"):
    """``model`` with each decoder layer under torch.compile, sharing the weights
    (``LlamaForCausalLM.with_layers``; the plain model, which the prefill graphs run, keeps its
    layers). The batch dimension of every input is marked dynamic, so one compile of a step
    (queries, tree) serves all its batch buckets above 1 (a batch of one is its own); every
    other size is static: dynamic widths would mix the target's and the draft's where both run
    in one process (SD). Embedding, rotary tables, final norm and head stay eager (a handful of
    kernels). Compiled in the graph pool's warm-up, before capture.

    Why dynamic batches (one H200, 3e7e4c0, docs/BENCHMARKS.md): the server's warm-up compiled
    9 steps instead of 23 and its cold start was ready in 59.6 s (87.8 s static, at 3041202);
    AR at b = 8 decoded at 4508 tok/s against 4392 static (1.03x, one bench invocation).
    ``SSDLIB_COMPILE_DYNAMIC=0`` compiles every bucket static, its own specialisation."""
    return compile_layers(model, model.model.layers, backend)


def compile_layers(model, layers, backend: str = "inductor"):
    """``model.with_layers`` of ``layers`` (its decoder layers), each under torch.compile as
    :func:`compile_step_model` says: a Llama's, or a feature draft's
    (``FeatureDraft.with_layers``)."""
    import torch._dynamo  # ~2-3 s of imports: only where something compiles

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), COMPILE_RECOMPILE_LIMIT))
    if env.flag("SSDLIB_COMPILE_DYNAMIC"):
        return model.with_layers(_BatchDynamic(torch.compile(layer, backend=backend,
                                                             dynamic=None))
                                 for layer in layers)
    return model.with_layers(torch.compile(layer, backend=backend, dynamic=False)
                             for layer in layers)


class _BatchDynamic(torch.nn.Module):
    """A compiled decoder layer called with the batch dimension of its hidden states and of
    every per-row tensor of its attention metadata marked dynamic
    (``torch._dynamo.mark_dynamic``), every other size static. A batch of one stays its own
    specialisation (dynamo specialises sizes 0 and 1)."""

    def __init__(self, compiled):
        super().__init__()
        self.compiled = compiled

    def __getattr__(self, name):  # the layer's own attributes (e.g. self_attn)
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.compiled, name)

    def forward(self, x, k_cache, v_cache, meta, *args, **kwargs):
        b = x.shape[0]
        if b > 1:
            for t in _row_tensors(meta, b):
                torch._dynamo.mark_dynamic(t, 0)
            torch._dynamo.mark_dynamic(x, 0)
        return self.compiled(x, k_cache, v_cache, meta, *args, **kwargs)


def _row_tensors(meta, b: int):
    """The tensors (also inside tuples) among ``meta``'s attributes whose first size is ``b``."""
    for value in vars(meta).values():
        for t in (value if isinstance(value, tuple) else (value,)):
            if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == b:
                yield t


# compile="auto" compiles a known workload from this many expected sequential decode steps
# (see resolve_compile)
COMPILE_MIN_STEPS = 20_000
COMPILE_SETTINGS = {"auto": None, "on": True, "off": False}


def compile_setting(value) -> bool | None:
    """``compile`` as given (True, False, None, or "auto" / "on" / "off") -> True, False or None
    (auto); ValueError for anything else."""
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in COMPILE_SETTINGS:
        return COMPILE_SETTINGS[value.lower()]
    raise ValueError(f"compile must be 'auto', 'on', 'off', True, False or None, got {value!r}")


def resolve_compile(setting: bool | None, prompts: int | None = None,
                    max_new_tokens: int | None = None, max_batch: int = 1) -> bool | None:
    """``compile`` once the work is known: True and False stay; auto (None) stays None (compile
    where :func:`wants_compile` says the steps can be) when the expected work amortises a
    compile, and becomes False when it does not.

    Why: on one H200 a compiled AR step took 1.13 ms against 1.99 ms uncompiled at b = 1 (0.86
    ms saved a step), while compiling took ~11-20 s at b = 1 and ~26-31 s at --max-batch 8
    (warm-up included): it pays back after roughly 13,000-35,000 steps. A one-prompt CLI call
    took 92 s compiled from cold against 24.9 s with --no-compile.

    The rule: an engine whose work is unknown (``prompts`` None: a server, the batch tool, a
    ``Generator`` not told its work) serves for long and compiles; a known workload compiles
    when its expected sequential decode steps, ceil(prompts / max_batch) * max_new_tokens,
    reach COMPILE_MIN_STEPS (20,000). One prompt of 128 new tokens does not compile (128
    steps); 1,000 prompts of 256 tokens at max_batch 8 do (32,000 steps). A speculative round
    decodes several tokens but runs several forwards (draft and verify), each compiled, so the
    same count stands for it. Compiled kernels persist in the cache directory
    (``compile_cache.py``), which makes a second start cheaper but does not change the rule."""
    if setting is not None or prompts is None:
        return setting
    steps = -(-prompts // max(1, max_batch)) * max(0, max_new_tokens or 0)
    return None if steps >= COMPILE_MIN_STEPS else False


def wants_compile(compile: bool | None, device: torch.device, cuda_graphs: bool, tp: int,
                  triton: bool | None = None) -> bool:
    """Whether the captured steps run the compiled layers: only on CUDA; ``compile=None``
    (auto, after :func:`resolve_compile`) where the steps are captured, the model is unsharded
    (TP 1; compiling the TP layers' collectives is not tested on GPU) and triton (inductor's
    kernel language) imports (``triton``: given, or checked)."""
    if device.type != "cuda":
        return False
    if compile is not None:
        return compile
    if not (cuda_graphs and tp == 1):
        return False
    if triton is None:
        triton = triton_available()
    return triton


def checked_step_model(model, cache, scratch_slot: int, use_kernel: bool,
                       backend: str = "inductor"):
    """:func:`compile_step_model`, tried once on a one-token step into the scratch slot (the
    decode shape, compiled now rather than in the first warm-up): where compiling fails (no
    working compiler or triton for inductor), a warning names the error and the captured steps
    run the plain model."""
    step = compile_step_model(model, backend)
    dev = cache.k.device
    ids = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    return _tried(step, model, lambda meta: step(ids, cache, meta), cache, scratch_slot,
                  use_kernel)


def checked_feature_step_draft(draft, cache, scratch_slot: int, use_kernel: bool,
                               backend: str = "inductor"):
    """A feature draft (``ssdlib.models.feature_draft``) with its decoder layers compiled
    (:func:`compile_layers`; the draft's fc, fuse, norm and the target's head stay eager),
    tried once on a one-pair step into the scratch slot of its KV ``cache``; the plain draft,
    with a warning, where compiling fails."""
    step = compile_layers(draft, draft.layers, backend)
    dev = cache.k.device
    ids = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    feats = torch.zeros(1, 1, draft.config.hidden_size, dtype=cache.k.dtype, device=dev)
    return _tried(step, draft, lambda meta: step(ids, feats, cache, meta), cache,
                  scratch_slot, use_kernel)


def _tried(step, plain, run, cache, scratch_slot: int, use_kernel: bool):
    """``step`` if ``run(meta)`` (its first call: a one-token step at position 0 of the scratch
    slot) compiles and runs, else ``plain`` and a warning naming the compiler's error."""
    dev = cache.k.device
    pos = torch.zeros(1, 1, dtype=torch.int64, device=dev)
    meta = AttentionMetadata(pos, torch.tensor([scratch_slot], device=dev), cache.max_len,
                             kv_limit=pos + 1, use_kernel=use_kernel)
    try:
        with torch.inference_mode():
            run(meta)
    except Exception as e:  # noqa: BLE001 - any compiler failure: run uncompiled
        root = e  # dynamo wraps the compiler's own error
        while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
            root = inner
        first = str(root).splitlines()[0] if str(root) else ""
        log.warning("torch.compile of the decoder layers failed (%s: %s); the captured steps "
                    "run the plain model (--no-compile silences this)", type(root).__name__,
                    first)
        return plain
    return step


def feature_compile_backend(compile: bool | None, device: torch.device,
                            cuda_graphs: bool) -> str | None:
    """The torch.compile backend of a feature draft's captured steps: "inductor" where a draft
    runner's steps would compile (:func:`wants_compile`, unsharded) and
    ``SSDLIB_FEATURE_COMPILE`` is on; else None (the plain draft)."""
    on = env.flag("SSDLIB_FEATURE_COMPILE") and wants_compile(
        compile, torch.device(device), cuda_graphs, 1)
    return "inductor" if on else None
