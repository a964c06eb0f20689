"""Llama weight names and shapes: the Hugging Face names ssdlib serves, their shapes under a
config, and the llama.cpp (GGUF) name of each."""

from __future__ import annotations

from ssdlib.config import ModelConfig

# GGUF per-block suffix -> HF per-layer suffix.
_GGUF_BLOCK = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_GLOBAL = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_name_for_gguf(name: str) -> str | None:
    """The HF name of GGUF tensor ``name`` (``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``), or ``None`` if it is not a Llama weight."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_BLOCK:
        return f"model.layers.{int(parts[1])}.{_GGUF_BLOCK[parts[2]]}"
    return None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of a Llama model under ``config``, HF name -> shape (``[out, in]`` for
    linears). ``lm_head.weight`` is listed only when embeddings are not tied."""
    h, inter = config.hidden_size, config.intermediate_size
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q_out, h),
            p + "self_attn.k_proj.weight": (kv_out, h),
            p + "self_attn.v_proj.weight": (kv_out, h),
            p + "self_attn.o_proj.weight": (h, q_out),
            p + "mlp.gate_proj.weight": (inter, h),
            p + "mlp.up_proj.weight": (inter, h),
            p + "mlp.down_proj.weight": (h, inter),
        })
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes
