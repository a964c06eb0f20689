"""A draft narrower than its target that reads the target's embedding through two trained
projections (tools/distill_draft.py --embedding-from-target --hidden < the target's; config.json
ssdlib_target_hidden_size): it trains with the target's matrix frozen, stores only its layers,
norm and projections, loads beside the target (ssdlib/loading/draft.py folds the projections in)
as exactly the trained function, continues with --init-from and --resume, materialises into a
plain HF directory, refuses a target of another width, and keeps SD exact."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

import tools.distill.models as models
from ssdlib import Generator, SamplingParams
from ssdlib.capacity import weight_bytes
from ssdlib.config import ModelConfig
from ssdlib.errors import CheckpointError
from ssdlib.loading import load_checkpoint
from ssdlib.loading.draft import load_draft, materialize_hf
from tests.draft_helpers import captured_export, checkpoint_logits
from tests.tiny import make_tiny_llama
from tools.distill_draft import main

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
PROJ = {EMBED: "model.embed_tokens.projection", HEAD: "lm_head.projection"}
DATA = ["--data", "random-target-samples", "--random-samples", "48", "--random-len", "32"]
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [20, 21, 22, 23, 24, 25, 26], [40, 41]]
GREEDY = SamplingParams(max_new_tokens=20, ignore_eos=True)


def run(target, out, *extra):
    return main(["--target", target, "--out", str(out), "--device", "cpu", "--seq-len", "32",
                 "--batch", "8", "--eval-samples", "8", "--eval-batch", "8",
                 "--embedding-from-target", "--hidden", "32", "--layers", "1", "--ffn", "64",
                 *extra])


IDS = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def trained(tiny_dirs, tmp_path_factory):
    """A 1-layer, 32-wide draft of the 72-wide target, 12 steps; the in-memory draft captured."""
    target = tiny_dirs["smol_heads"]
    out = tmp_path_factory.mktemp("projected_distill") / "draft"
    with captured_export() as captured:
        report = run(target, out, *DATA, "--steps", "12", "--lr", "3e-3", "--eval-every", "6",
                     "--save-every", "6", "--storage-dtype", "float32")
    return target, str(out), report, captured["draft"]


def test_export_stores_layers_norm_and_the_projections(trained):
    target, out, report, _ = trained
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert EMBED not in tensors and HEAD not in tensors
    assert tensors[PROJ[EMBED]].shape == tensors[PROJ[HEAD]].shape == (72, 32)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["ssdlib_embedding_from_target"] is True
    assert cfg["ssdlib_target_hidden_size"] == 72 and cfg["tie_word_embeddings"] is False
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        32, 4, 2)
    stored = sum(t.numel() for t in tensors.values())
    layer = 32 * 8 * (2 * 4 + 2 * 2) + 3 * 32 * 64 + 2 * 32
    assert report["draft"]["params"] == stored == layer + 32 + 2 * 72 * 32


def test_training_moves_the_projections_and_lowers_kl(trained):
    target, _, report, draft = trained
    target_ck = load_checkpoint(target)
    base = target_ck.weights.get(EMBED)
    proj = draft.model.embed_tokens.parametrizations.weight.original
    assert proj.requires_grad and proj.shape == (72, 32)
    # the embedding the draft computes is the target's times its projection
    assert torch.allclose(draft.model.embed_tokens.weight, base @ proj, atol=1e-6)
    assert all(not p.requires_grad or p is not base for p in draft.parameters())
    history = report["history"]
    assert [h["step"] for h in history] == [0, 6, 12]
    assert history[-1]["kl"] < history[0]["kl"], history


def test_fresh_projections_start_at_the_principal_directions(tiny_dirs):
    """Step 0 of a fresh projected draft has the embedding an --init-embeddings-from-target
    draft of the same width starts with (its own, not tied to a head)."""
    ck = load_checkpoint(tiny_dirs["smol_heads"])
    c = ck.config
    cfg = models.draft_config(c, 32, 1, 4, 2, 64, embedding_from_target=True)
    assert cfg.target_hidden_size == 72 and not cfg.tie_word_embeddings
    draft = models.build_draft(cfg, torch.device("cpu"), 64, seed=0)
    models.project_target_embedding(draft, ck, fresh=True)
    own_cfg = models.draft_config(c, 32, 1, 4, 2, 64)
    own = models.build_draft(own_cfg, torch.device("cpu"), 64, seed=0)
    models.init_embeddings_from_target(own, ck)
    with torch.no_grad():
        assert torch.allclose(draft.model.embed_tokens.weight, own.model.embed_tokens.weight,
                              atol=1e-5)
        assert torch.allclose(draft.lm_head.weight, own.model.embed_tokens.weight, atol=1e-5)


def test_export_loads_beside_the_target_as_the_trained_draft(trained):
    target, out, _, draft = trained
    ck = load_draft(out, load_checkpoint(target))
    assert ck.config.projects_target_embedding
    assert PROJ[EMBED] not in ck.weights.names() and EMBED in ck.weights.names()
    assert ck.weights.shape(EMBED) == ck.weights.shape(HEAD) == (90, 32)
    # a vocab shard of the folded matrix is the same rows of the whole
    assert torch.allclose(ck.weights.get(HEAD, dim=0, start=3, stop=7),
                          ck.weights.get(HEAD)[3:7])
    with torch.no_grad():
        ref = draft.forward_full(IDS)
    assert torch.allclose(checkpoint_logits(ck, IDS), ref, atol=1e-4), (checkpoint_logits(ck, IDS) - ref).abs().max()


def test_init_from_keeps_the_function_exactly(trained, tmp_path):
    """--init-from a projected draft recovers its projections (least squares on the folded
    weights): step 0 of the new run is the source's function."""
    target, out, report, _ = trained
    data = os.path.join(out + ".work", "data.safetensors")
    cont = main(["--target", target, "--out", str(tmp_path / "c"), "--device", "cpu",
                 "--seq-len", "32", "--batch", "8", "--eval-batch", "8", "--data-from", data,
                 "--init-from", out, "--steps", "2", "--eval-every", "1", "--lr", "1e-3"])
    assert abs(cont["history"][0]["kl"] - report["history"][-1]["kl"]) < 1e-4
    with open(os.path.join(tmp_path / "c", "config.json")) as f:
        assert json.load(f)["ssdlib_target_hidden_size"] == 72


def test_resume_continues_the_same_run(trained, tmp_path):
    target, out, _, _ = trained
    data = os.path.join(out + ".work", "data.safetensors")
    common = ["--data-from", data, "--schedule", "constant", "--lr", "3e-3",
              "--eval-every", "3", "--save-every", "3"]
    straight = run(target, tmp_path / "a", *common, "--steps", "6")
    first = run(target, tmp_path / "b", *common, "--steps", "3")
    assert first["step"] == 3
    state = torch.load(os.path.join(str(tmp_path / "b") + ".work", "last.pt"),
                       weights_only=True)
    assert "model.embed_tokens.parametrizations.weight.original" in state["model"]
    assert not any(k.endswith(".base") for k in state["model"])  # the target's: not saved
    resumed = main(["--target", target, "--out", str(tmp_path / "b"), "--device", "cpu",
                    "--resume", "--steps", "6"])
    assert resumed["step"] == 6 and resumed["tokens_seen"] == straight["tokens_seen"]
    a = load_file(os.path.join(tmp_path / "a", "model.safetensors"))
    b = load_file(os.path.join(tmp_path / "b", "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k].float(), b[k].float(), atol=1e-3), k


def test_config_round_trip_and_validation():
    d = {"vocab_size": 90, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
         "ssdlib_embedding_from_target": True, "ssdlib_target_hidden_size": 72}
    cfg = ModelConfig.from_hf_dict(d)
    assert cfg.projects_target_embedding and cfg.target_hidden_size == 72
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    # at run time it holds the folded embedding and head, like any untied draft of its width
    assert weight_bytes(cfg, 1, 2) == weight_bytes(
        ModelConfig.from_hf_dict({k: v for k, v in d.items() if not k.startswith("ssdlib")}),
        1, 2)
    for bad, match in (({"ssdlib_embedding_from_target": False}, "only meaningful with"),
                       ({"tie_word_embeddings": True}, "tie_word_embeddings must be false"),
                       ({"ssdlib_target_hidden_size": "72"}, "must be a positive integer")):
        with pytest.raises(CheckpointError, match=match):
            ModelConfig.from_hf_dict(dict(d, **bad))


def test_a_target_of_another_width_is_refused(trained, tmp_path):
    _, out, _, _ = trained
    other = load_checkpoint(make_tiny_llama(str(tmp_path / "wide"), "smol_heads",
                                            hidden_size=90, intermediate_size=96))
    with pytest.raises(CheckpointError,
                       match="ssdlib_target_hidden_size .* is 72 and the target .* has 90"):
        load_draft(out, other)


def test_a_missing_or_misshapen_projection_is_named(trained, tmp_path):
    _, out, _, _ = trained
    tensors = load_file(os.path.join(out, "model.safetensors"))
    for case, change in (("missing", lambda t: t.pop(PROJ[HEAD])),
                         ("shape", lambda t: t.__setitem__(PROJ[HEAD], t[PROJ[HEAD]][:, :16]))):
        d = tmp_path / case
        os.makedirs(d)
        t = dict(tensors)
        change(t)
        save_file({k: v.contiguous() for k, v in t.items()}, str(d / "model.safetensors"))
        with open(os.path.join(out, "config.json")) as f:
            (d / "config.json").write_text(f.read())
        with pytest.raises(CheckpointError, match="lm_head.projection' of shape \\(72, 32\\)"):
            load_checkpoint(str(d))


def test_materialize_hf_writes_the_folded_matrices(trained, tmp_path):
    target, out, _, _ = trained
    target_ck = load_checkpoint(target)
    plain = materialize_hf(out, target_ck, str(tmp_path / "hf"))
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    assert "ssdlib_target_hidden_size" not in cfg and "ssdlib_embedding_from_target" not in cfg
    tensors = load_file(os.path.join(plain, "model.safetensors"))
    assert PROJ[EMBED] not in tensors and tensors[HEAD].shape == (90, 32)
    ck = load_checkpoint(plain)
    assert torch.allclose(checkpoint_logits(ck, IDS), checkpoint_logits(load_draft(out, target_ck), IDS), atol=1e-5)


@pytest.fixture(scope="module")
def ar_reference(trained):
    with Generator(target=trained[0], max_batch=4, max_len=128) as g:
        return [o.token_ids for o in g.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("mode,placement", [("sd", "leader"), ("ssd", "leader")])
def test_sd_and_ssd_with_a_projected_draft_equal_ar(trained, ar_reference, mode, placement):
    """In-process SD and SSD with its speculator rank: both load the draft beside the target."""
    target, out, _, _ = trained
    with Generator(target=target, draft=out, mode=mode, draft_placement=placement, k=4,
                   max_batch=2, max_len=128) as g:
        outs = g.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_reference
