"""tools/grow_layers.py: a deeper draft that computes the same function as its source."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))

import grow_layers  # noqa: E402

from ssdlib.loading import load_checkpoint  # noqa: E402
from ssdlib.models.llama import LlamaForCausalLM  # noqa: E402


def test_layer_plan_spreads_the_copies_evenly():
    assert grow_layers.layer_plan(6, 12) == [(i, c) for i in range(6) for c in (False, True)]
    plan = grow_layers.layer_plan(3, 5)
    assert [i for i, c in plan if not c] == [0, 1, 2] and sum(c for _, c in plan) == 2
    assert grow_layers.layer_plan(4, 4) == [(i, False) for i in range(4)]
    with pytest.raises(ValueError):
        grow_layers.layer_plan(4, 3)


def _logits(path, ids):
    ck = load_checkpoint(path)
    model = LlamaForCausalLM(ck.config)
    model.load_weights(ck.weights)
    with torch.no_grad():
        return model.eval().forward_full(ids), ck.config.num_hidden_layers


def test_grown_draft_has_the_layers_and_the_same_logits(tiny_dirs, tmp_path):
    src = tiny_dirs["smol_heads_draft"]
    out = str(tmp_path / "grown")
    n_src = load_checkpoint(src).config.num_hidden_layers
    assert grow_layers.main([src, str(2 * n_src + 1), out]) == 0
    ids = torch.randint(0, load_checkpoint(src).config.vocab_size, (2, 9),
                        generator=torch.Generator().manual_seed(1))
    want, _ = _logits(src, ids)
    got, n = _logits(out, ids)
    assert n == 2 * n_src + 1
    assert (want - got).abs().max().item() <= 1e-5
    # the copies are not dead: their input projections are the source layer's, nonzero
    grown = load_checkpoint(out)
    assert grown.weights.get("model.layers.1.self_attn.q_proj.weight").abs().sum() > 0
    assert grown.weights.get("model.layers.1.mlp.down_proj.weight").abs().sum() == 0
