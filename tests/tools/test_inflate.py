"""tools/inflate.py: the inflated checkpoint computes its source's function (ssdlib and HF
transformers, fp32), its extra weights do real work, and ``--like`` shapes count right."""

import json
import math
import os

import pytest
import torch

from ssdlib.config import ModelConfig
from ssdlib.engine.runner.kv_cache import KVCache
from ssdlib.layers.attention import AttentionMetadata
from ssdlib.loading import load_checkpoint
from ssdlib.loading.hf_dir import SafetensorsWeights
from ssdlib.models.llama import LlamaForCausalLM
from tools.inflate import LIKE, head_layout, inflate, main, report, source_shape, target_shape

# tiny source -> explicit bigger shape (more layers, wider hidden / ffn, more heads)
CASES = {
    "gqa": dict(layers=5, hidden=96, ffn=160, heads=12, kv_heads=4),  # GQA group 2 -> 3
    "smol_heads": dict(layers=3, hidden=96, ffn=128, heads=12, kv_heads=6),  # 3 -> 2: KV copied
    # head_dim 8 -> 16 under Llama-3 RoPE scaling
    "llama3_tied": dict(layers=4, hidden=64, ffn=128, heads=8, kv_heads=4, head_dim=16),
}
DRAFT = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                     "ssdlib", "assets", "smollm2-135m-draft")


def build(path, max_len=128):
    ck = load_checkpoint(path)
    m = LlamaForCausalLM(ck.config, None, max_len)
    m.load_weights(ck.weights)
    return m.eval()


def greedy(m, prompt: list[int], n: int) -> list[int]:
    """n greedy tokens through the KV cache (prefill, then one-token steps)."""
    cfg = m.config
    cache = KVCache(cfg.num_hidden_layers, 1, m.kv_heads_local, len(prompt) + n, cfg.head_dim,
                    torch.float32, "cpu")
    ids, out = torch.tensor([prompt]), []
    with torch.no_grad():
        for _ in range(n):
            start = len(prompt) + len(out) - ids.shape[1]
            pos = start + torch.arange(ids.shape[1]).view(1, -1)
            logits = m(ids, cache, AttentionMetadata.build(pos, torch.tensor([0])))
            out.append(int(logits[0, -1].argmax()))
            ids = torch.tensor([[out[-1]]])
    return out


def prompts(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (1, n), generator=g) for n in (5, 17, 40)]


@pytest.fixture(scope="module")
def inflated(tiny_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("inflated")
    out = {}
    for name, sizes in CASES.items():
        out[name] = str(root / name)
        inflate(tiny_dirs[name], out[name], dtype="float32", seed=3, progress=False, shard_mb=1,
                **sizes)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_equal_the_source(tiny_dirs, inflated, name):
    from transformers import AutoModelForCausalLM

    src, big = build(tiny_dirs[name]), build(inflated[name])
    hf_src = AutoModelForCausalLM.from_pretrained(tiny_dirs[name], dtype=torch.float32).eval()
    hf_big = AutoModelForCausalLM.from_pretrained(inflated[name], dtype=torch.float32).eval()
    assert hf_big.config.num_hidden_layers == CASES[name]["layers"]
    with torch.no_grad():
        for ids in prompts(src.config.vocab_size):
            ref = src.forward_full(ids)
            assert (big.forward_full(ids) - ref).abs().max().item() <= 1e-4
            assert (hf_big(ids).logits - hf_src(ids).logits).abs().max().item() <= 1e-4
    for ids in prompts(src.config.vocab_size, seed=1):
        assert greedy(big, ids[0].tolist(), 32) == greedy(src, ids[0].tolist(), 32)


def test_sharded_output_and_config(tiny_dirs, inflated):
    out = inflated["gqa"]
    index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 1  # shard_mb=1: several files
    cfg = json.load(open(os.path.join(out, "config.json")))
    src = json.load(open(os.path.join(tiny_dirs["gqa"], "config.json")))
    assert math.isclose(cfg["rms_norm_eps"], src["rms_norm_eps"] * 64 / 96)
    assert cfg["rope_theta"] == 10000.0 and cfg["vocab_size"] == src["vocab_size"]
    wide = json.load(open(os.path.join(inflated["llama3_tied"], "config.json")))
    assert math.isclose(wide["rope_theta"], 500000.0 ** 2)  # head_dim 8 -> 16: same frequencies
    assert wide["rope_scaling"]["rope_type"] == "llama3"


def test_extra_weights_do_work_and_writers_are_cancelled(tiny_dirs, inflated):
    s = source_shape(load_checkpoint(tiny_dirs["gqa"]).config)  # 2 layers, d 64, ffn 112, 4/2
    w = SafetensorsWeights(inflated["gqa"])
    t = CASES["gqa"]
    d, hd = s.hidden, s.head_dim
    q_to, kv_to = head_layout(s.heads, s.kv_heads, t["heads"], t["kv_heads"])
    extra_q = [h for h in range(t["heads"]) if h not in q_to]
    extra_kv = [h for h in range(t["kv_heads"]) if h not in sum(kv_to, [])]
    assert extra_q and extra_kv
    assert not w.get("model.embed_tokens.weight")[:, d:].any()
    for i in range(t["layers"]):
        p = f"model.layers.{i}."
        q = w.get(p + "self_attn.q_proj.weight").view(t["heads"], hd, -1)
        k = w.get(p + "self_attn.k_proj.weight").view(t["kv_heads"], hd, -1)
        v = w.get(p + "self_attn.v_proj.weight").view(t["kv_heads"], hd, -1)
        o = w.get(p + "self_attn.o_proj.weight").view(-1, t["heads"], hd)
        gate, up = w.get(p + "mlp.gate_proj.weight"), w.get(p + "mlp.up_proj.weight")
        down = w.get(p + "mlp.down_proj.weight")
        # real work: every extra head / MLP channel has nonzero input weights
        assert all(q[h].abs().sum(-1).gt(0).all() for h in extra_q)
        assert all(k[h].abs().sum(-1).gt(0).all() and v[h].abs().sum(-1).gt(0).all()
                   for h in extra_kv)
        assert gate[s.ffn:].abs().sum(-1).gt(0).all() and up[s.ffn:].abs().sum(-1).gt(0).all()
        # ... and nothing of it reaches the residual stream
        assert not o[d:].any() and not o[:, extra_q].any() and not down[d:].any()
        assert not down[:, s.ffn:].any()
        if i >= s.layers:  # identity block
            assert not o.any() and not down.any() and q.abs().sum(-1).gt(0).all()
        else:
            assert o[:d, q_to].abs().sum() > 0 and down[:d, :s.ffn].abs().sum() > 0
        norm = w.get(p + "input_layernorm.weight")
        if i < s.layers:
            src_norm = load_checkpoint(tiny_dirs["gqa"]).weights.get(p + "input_layernorm.weight")
            torch.testing.assert_close(norm[:d], src_norm * math.sqrt(d / t["hidden"]))


def test_head_layout_keeps_gqa_groups():
    # SmolLM2 9/3 -> 64/16: group 3 -> 4, source q heads fill the first 3 slots of KV heads 0..2
    q_to, kv_to = head_layout(9, 3, 64, 16)
    assert q_to == [0, 1, 2, 4, 5, 6, 8, 9, 10] and kv_to == [[0], [1], [2]]
    for src, dst in (((9, 3), (12, 6)), ((4, 2), (64, 16)), ((6, 2), (8, 4)), ((8, 8), (32, 8)),
                     ((4, 1), (16, 16))):
        q_to, kv_to = head_layout(*src, *dst)
        g, g2 = src[0] // src[1], dst[0] // dst[1]
        assert len(set(q_to)) == src[0] and max(q_to) < dst[0]
        assert all(q_to[i] // g2 in kv_to[i // g] for i in range(src[0]))
    with pytest.raises(ValueError, match="kv-heads >= 6"):
        head_layout(9, 3, 8, 4)  # groups of 3 over groups of 2: two KV heads per source one


SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                      num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                      head_dim=64, tie_word_embeddings=True)


def test_like_shapes_count_analytically():
    assert LIKE["llama-3.1-8b"].params()[0] == 8_030_261_248  # the published counts
    assert LIKE["llama-3.2-1b"].params()[0] == 1_235_814_400
    draft = ModelConfig.from_hf_dict(json.load(open(os.path.join(DRAFT, "config.json"))))
    for cfg, like, heads in ((SMOLLM2, "llama-3.1-8b", (64, 16)),
                             (draft, "llama-3.2-1b", (64, 16))):
        src = source_shape(cfg)
        dst = target_shape(cfg, like)  # the source's head_dim, the named q / KV widths
        assert (dst.heads, dst.kv_heads, dst.head_dim) == (*heads, src.head_dim)
        assert dst.params()[1] == LIKE[like].params()[1]  # non-embedding: equal
        lines, dev = report(src, dst, "bfloat16", like)
        assert dev == 0.0 and any("non-embedding +0.0%" in line for line in lines)
        padded = target_shape(cfg, like, match_total=True)
        assert padded.ffn % 256 == 0 and padded.ffn > dst.ffn
        assert abs(padded.params()[0] / LIKE[like].params()[0] - 1) < 0.02
    wide = target_shape(SMOLLM2, "llama-3.1-8b", head_dim=128)
    assert (wide.heads, wide.kv_heads) == (32, 8) and wide.params() == (
        LIKE["llama-3.1-8b"].params()[1] + 49152 * 4096, LIKE["llama-3.1-8b"].params()[1])


def test_like_dry_run_prints_counts_and_writes_nothing(tmp_path, capsys):
    out = str(tmp_path / "d1b")
    assert main([DRAFT, out, "--like", "llama-3.2-1b", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    # the shipped draft (version 5) is untied: its own head beside the embedding
    assert "heads 64/16 x head_dim 32" in printed and "1,174,472,704" in printed
    assert "non-embedding +0.0%" in printed and "2.35 GB in bfloat16" in printed
    assert not os.path.exists(out)


def test_cli_errors(tiny_dirs, tmp_path, capsys):
    out = str(tmp_path / "x")
    assert main([tiny_dirs["gqa"], out, "--hidden", "32", "--layers", "2", "--ffn", "112",
                 "--heads", "4", "--kv-heads", "2"]) == 2
    assert "smaller than the source's 64" in capsys.readouterr().err
    assert main([tiny_dirs["gqa"], out, "--layers", "3"]) == 2
    assert "missing --hidden --ffn --heads --kv-heads" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "config.json"))


def test_shipped_draft_keeps_its_tokenizer_pointer(smollm2_path, tmp_path, capsys):
    """The shipped draft reads SmolLM2's embedding through projections: without --target it is
    refused by name; with it, the target's embedding is folded in and OUT is a plain Llama that
    computes the draft's function."""
    from ssdlib.loading.draft import load_draft

    out = str(tmp_path / "draft")
    grow = ["--layers", "8", "--hidden", "320", "--ffn", "1280", "--heads", "10",
            "--kv-heads", "5", "--dtype", "float32"]
    assert main([DRAFT, out] + grow) == 2
    assert "reads its target's embedding" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "config.json"))
    assert main([DRAFT, out, "--target", smollm2_path] + grow) == 0
    assert "parameters" in capsys.readouterr().out
    assert open(os.path.join(out, "tokenizer_source.json")).read() == open(
        os.path.join(DRAFT, "tokenizer_source.json")).read()
    config = json.load(open(os.path.join(out, "config.json")))
    assert not any(k.startswith("ssdlib_") for k in config), config
    src_ck = load_draft(DRAFT, load_checkpoint(smollm2_path))
    src = LlamaForCausalLM(src_ck.config, None, 128)
    src.load_weights(src_ck.weights)
    src, big = src.eval(), build(out)
    for ids in prompts(49152)[:2]:
        with torch.no_grad():
            assert (big.forward_full(ids) - src.forward_full(ids)).abs().max().item() <= 1e-4


def test_smollm2_inflated(smollm2_path, tmp_path):
    """SmolLM2-135M (GGUF) -> 32 layers, hidden 768, 12/4 heads: same logits, same tokenizer."""
    out = str(tmp_path / "smol")
    src_ck = load_checkpoint(smollm2_path)
    src = LlamaForCausalLM(src_ck.config, None, 64).eval()
    src.load_weights(src_ck.weights)
    inflate(src_ck, out, dtype="float32", progress=False, layers=32, hidden=768, ffn=2048,
            heads=12, kv_heads=4)
    big_ck = load_checkpoint(out)
    assert big_ck.tokenizer.fingerprint() == src_ck.tokenizer.fingerprint()
    big = build(out, 64)
    for text in ("def fibonacci(n):", "The capital of France is", "Once upon a time, in a"):
        ids = torch.tensor([src_ck.tokenizer.encode(text)])
        with torch.no_grad():
            assert (big.forward_full(ids) - src.forward_full(ids)).abs().max().item() <= 1e-4
