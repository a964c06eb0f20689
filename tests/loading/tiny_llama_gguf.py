"""Tiny synthetic Llama GGUF files for the loading tests, written with ``gguf.GGUFWriter`` the
way llama.cpp's converter writes them (q/k rows permuted, norms in F32)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# A llama small enough to write in milliseconds; every row length is a multiple of 32 so all
# block-quantized types apply.
TINY = dict(vocab=260, hidden=64, inter=96, layers=2, heads=4, kv_heads=2, head_dim=16)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """The q/k row permutation of llama.cpp's convert_hf_to_gguf.py (the reference we undo)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocabulary of TINY['vocab'] tokens: 3 specials, 256 bytes, one merge."""
    from ssdlib.tokenizer.builders import byte_alphabet

    tokens = SPECIALS + [byte_alphabet()[b] for b in range(256)] + ["\u0120t"]
    types = [3] * len(SPECIALS) + [1] * 257
    return tokens, types, ["\u0120 t"]


@dataclass
class TinyGGUF:
    path: str
    # Original float32 weights under HF names, in HF layout (q/k not permuted).
    weights: dict[str, np.ndarray] = field(default_factory=dict)


def write_tiny_gguf(path: str, qtype=None, *, tied: bool = False, arch: str = "llama",
                    rope_freqs: np.ndarray | None = None, shape_overrides: dict | None = None,
                    drop: tuple[str, ...] = (), seed: int = 0) -> TinyGGUF:
    """Write a random tiny Llama GGUF; 2-D weights in ``qtype`` (default F32), norms in F32."""
    import gguf
    from gguf import GGMLQuantizationType as Q
    from gguf.quants import quantize

    qtype = Q.F32 if qtype is None else qtype
    c = TINY
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(c["layers"])
    w.add_context_length(256)
    w.add_embedding_length(c["hidden"])
    w.add_feed_forward_length(c["inter"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv_heads"])
    w.add_rope_dimension_count(c["head_dim"])
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    tokens, types, merges = tiny_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(0)
    w.add_chat_template(CHATML)

    out = TinyGGUF(path)
    h, hd = c["hidden"], c["head_dim"]
    shapes = {"token_embd.weight": (c["vocab"], h), "output_norm.weight": (h,)}
    if not tied:
        shapes["output.weight"] = (c["vocab"], h)
    for i in range(c["layers"]):
        shapes.update({
            f"blk.{i}.attn_norm.weight": (h,), f"blk.{i}.ffn_norm.weight": (h,),
            f"blk.{i}.attn_q.weight": (c["heads"] * hd, h),
            f"blk.{i}.attn_k.weight": (c["kv_heads"] * hd, h),
            f"blk.{i}.attn_v.weight": (c["kv_heads"] * hd, h),
            f"blk.{i}.attn_output.weight": (h, c["heads"] * hd),
            f"blk.{i}.ffn_gate.weight": (c["inter"], h), f"blk.{i}.ffn_up.weight": (c["inter"], h),
            f"blk.{i}.ffn_down.weight": (h, c["inter"]),
        })
    shapes.update(shape_overrides or {})
    for name in drop:
        del shapes[name]
    from ssdlib.loading.llama_names import hf_name_for_gguf

    for name, shape in shapes.items():
        value = rng.standard_normal(shape).astype(np.float32)
        out.weights[hf_name_for_gguf(name)] = value
        stored = value
        if ".attn_q." in name:
            stored = llama_cpp_permute(value, c["heads"], c["heads"])
        elif ".attn_k." in name:
            stored = llama_cpp_permute(value, c["heads"], c["kv_heads"])
        t = qtype if len(shape) == 2 else Q.F32
        data = quantize(stored, t)
        w.add_tensor(name, data, raw_shape=data.shape if t in (Q.F32, Q.F16) else None,
                     raw_dtype=t)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


