"""tools/widen_draft.py: a wider copy of a draft, reading the target's embedding through
projections, computes the source's function (exactly up to RMSNorm's eps for a source that
stores projections or whose embedding the target's spans; a source with its own embedding
otherwise changes by the reported least-squares fit), refuses what is not a widening, and
trains with distill_draft.py --init-from."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

import tools.distill.models as models
from ssdlib.loading import load_checkpoint
from ssdlib.loading.draft import load_draft
from tests.draft_helpers import checkpoint_logits
from tools.distill_draft import main as distill_main
from tools.widen_draft import main as widen_main

IDS = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))
DATA = ["--data", "random-target-samples", "--random-samples", "16", "--random-len", "24"]


def logits(ck):
    return checkpoint_logits(ck, IDS)


def make_draft(target_dir, out, projected: bool, perturb: float = 0.0) -> str:
    """A 2-layer, 32-wide draft of the 72-wide tiny target with random layers: its embedding
    the target's through projections, or its own (the target's principal directions, plus
    ``perturb`` noise the target's embedding cannot span)."""
    ck = load_checkpoint(target_dir)
    cfg = models.draft_config(ck.config, 32, 2, 4, 2, 64, embedding_from_target=projected)
    draft = models.build_draft(cfg, torch.device("cpu"), 64, seed=1)
    with torch.no_grad():
        for name, p in draft.named_parameters():  # norms away from 1: the scaling matters
            if p.dim() == 1:
                p.uniform_(0.5, 1.5, generator=torch.Generator().manual_seed(len(name)))
    if projected:
        models.project_target_embedding(draft, ck, fresh=True)
        with torch.no_grad():
            proj = draft.lm_head.parametrizations.weight.original
            proj.add_(0.05 * torch.randn(proj.shape, generator=torch.Generator().manual_seed(2)))
    else:
        models.init_embeddings_from_target(draft, ck)
        with torch.no_grad():
            w = draft.model.embed_tokens.weight
            w.add_(perturb * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)))
    models.export_hf(draft, ck, out, "float32")
    return out


@pytest.mark.parametrize("projected", [True, False])
def test_the_wider_draft_computes_the_same_function(tiny_dirs, tmp_path, projected, capsys):
    target = tiny_dirs["smol_heads"]
    src = make_draft(target, str(tmp_path / "src"), projected)
    out = str(tmp_path / "wide")
    assert widen_main([src, out, "--target", target, "--hidden", "64", "--ffn", "128"]) == 0
    printed = capsys.readouterr().out
    assert "heads 4/2 -> 8/4" in printed
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["intermediate_size"], cfg["ssdlib_target_hidden_size"],
            cfg["tie_word_embeddings"]) == (64, 8, 4, 128, 72, False)
    target_ck = load_checkpoint(target)
    wide = load_draft(out, target_ck)
    ref = logits(load_draft(src, target_ck))
    got = logits(wide)
    # RMSNorm's eps now meets a mean of squares over twice the width
    assert torch.allclose(got, ref, atol=2e-3, rtol=1e-3), (got - ref).abs().max()
    # the new entries are there: not a zero-padded copy that training could not move
    q = wide.weights.get("model.layers.0.self_attn.q_proj.weight")
    assert q[32:].abs().sum() > 0 and q[:32, 32:].abs().sum() > 0
    o = wide.weights.get("model.layers.0.self_attn.o_proj.weight")
    assert o[32:].abs().sum() == 0 and o[:, 32:].abs().sum() == 0


def test_an_own_embedding_the_target_cannot_span_is_fitted(tiny_dirs, tmp_path, capsys):
    target = tiny_dirs["smol_heads"]
    src = make_draft(target, str(tmp_path / "src"), projected=False, perturb=0.05)
    out = str(tmp_path / "wide")
    widen_main([src, out, "--target", target, "--hidden", "48", "--heads", "6",
                "--kv-heads", "3", "--ffn", "96"])
    residual = float(capsys.readouterr().out.split("model.embed_tokens.weight ")[1].split(",")[0])
    assert 0.01 < residual < 1.0
    target_ck = load_checkpoint(target)
    got, ref = logits(load_draft(out, target_ck)), logits(load_checkpoint(src))
    assert not torch.allclose(got, ref, atol=1e-3)  # the fit changed it a little
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.5


@pytest.mark.parametrize("extra,match", [
    (["--hidden", "16"], "below the source's 32"),
    (["--hidden", "64", "--heads", "8", "--kv-heads", "2"], "2 query heads per KV head"),
    (["--hidden", "72"], "not below the target's 72"),
])
def test_what_is_not_a_widening_is_refused(tiny_dirs, tmp_path, extra, match):
    target = tiny_dirs["smol_heads"]
    src = make_draft(target, str(tmp_path / "src"), projected=True)
    with pytest.raises(SystemExit, match=match):
        widen_main([src, str(tmp_path / "w"), "--target", target, *extra])


def test_the_wider_draft_trains_from_where_it_starts(tiny_dirs, tmp_path):
    """distill_draft.py --init-from the widened draft: step 0's held-out KL is the source's
    (same data), and it trains."""
    target = tiny_dirs["smol_heads"]
    src = make_draft(target, str(tmp_path / "src"), projected=False)
    out = str(tmp_path / "wide")
    widen_main([src, out, "--target", target, "--hidden", "64"])
    reports = [distill_main(["--target", target, "--out", str(tmp_path / name), "--device",
                             "cpu", "--seq-len", "24", "--batch", "4", "--eval-samples", "4",
                             "--eval-batch", "4", *DATA, "--init-from", start, "--steps", "2",
                             "--eval-every", "1", "--lr", "1e-3"])
               for name, start in (("from_src", src), ("from_wide", out))]
    kl_src, kl_wide = (r["history"][0]["kl"] for r in reports)
    assert abs(kl_wide - kl_src) < 1e-2 * max(1.0, kl_src), (kl_src, kl_wide)
    stored = load_file(os.path.join(out, "model.safetensors"))
    assert reports[1]["step"] == 2
    assert reports[1]["draft"]["params"] == sum(t.numel() for t in stored.values())
    with open(os.path.join(tmp_path / "from_wide", "config.json")) as f:
        assert json.load(f)["hidden_size"] == 64


def test_embeddings_first_keeps_the_layers_then_trains_them(tiny_dirs, tmp_path):
    """distill_draft.py --embeddings-first N: the first N steps move only the two projections
    (a widened draft's layers stay as they were); later steps move the layers too; a run
    resumed inside those N steps continues (the waiting layers are in its checkpoint)."""
    target = tiny_dirs["smol_heads"]
    src = make_draft(target, str(tmp_path / "src"), projected=False, perturb=0.05)
    wide = str(tmp_path / "wide")
    widen_main([src, wide, "--target", target, "--hidden", "64"])
    common = ["--target", target, "--device", "cpu", "--seq-len", "24", "--batch", "4",
              "--eval-samples", "4", "--eval-batch", "4", "--lr", "3e-3", "--warmup", "0",
              "--embeddings-first", "2", "--storage-dtype", "float32", "--save-every", "1"]
    start = load_file(os.path.join(wide, "model.safetensors"))
    layer = "model.layers.0.mlp.up_proj.weight"
    proj = "lm_head.projection"
    out = {}
    for steps in (2, 3):
        d = tmp_path / f"s{steps}"
        distill_main([*common, *DATA, "--out", str(d), "--init-from", wide, "--steps",
                      str(steps)])
        out[steps] = load_file(os.path.join(d, "model.safetensors"))
    assert torch.equal(out[2][layer], start[layer])
    assert not torch.allclose(out[2][proj], start[proj])
    assert not torch.allclose(out[3][layer], start[layer])
    d = tmp_path / "resumed"
    distill_main([*common, *DATA, "--out", str(d), "--init-from", wide, "--steps", "1"])
    report = distill_main(["--target", target, "--out", str(d), "--device", "cpu", "--resume",
                           "--steps", "3"])
    assert report["step"] == 3
    resumed = load_file(os.path.join(d, "model.safetensors"))
    assert torch.allclose(resumed[layer], out[3][layer], atol=1e-5)
