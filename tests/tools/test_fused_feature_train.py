"""Training and evaluating a fused feature draft (tools/distill_feature_draft.py --features fused,
tools/distill/feature_train.py, tools/distill/feature_eval.py) on CPU: an exact fused oracle has
zero loss at every unroll step and is accepted everywhere offline (the target's features reach
it through its fuse, its own h stands in unfused), the CLI writes a fused draft that loads and
whose held-out KL drops, --fused-layers and --init-from keep the kind, and the size limit counts
fuse."""

import json

import pytest
import torch
from safetensors.torch import load_file

from ssdlib.loading import load_checkpoint
from ssdlib.loading.feature_draft import load_feature_draft, stored_mb
from ssdlib.models.feature_draft import FeatureDraft
from ssdlib.models.feature_spec import FeatureSpec
from tests.feature_oracle import FUSED_LAYERS, V, PreviousTokenTarget, oracle_draft
from tests.tiny import make_tiny_llama
from tests.tools.test_feature_draft_train import SEQ, sample_docs, settings
from tools.distill.data import Docs, save_splits
from tools.distill.feature_eval import acceptance_rows
from tools.distill.feature_train import teacher_outputs, unrolled_losses
from tools.distill.models import load_teacher
from tools.distill_feature_draft import main


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 4-layer tiny target (default fused layers 1, 2, 3) and data.safetensors of its
    samples."""
    root = tmp_path_factory.mktemp("fused_train")
    target = make_tiny_llama(str(root / "target"), "gqa", scale=2.0, num_hidden_layers=4)
    teacher = load_teacher(load_checkpoint(target), torch.device("cpu"), torch.float32, 256)
    data = str(root / "data.safetensors")
    save_splits(data, sample_docs(teacher, 64, SEQ, seed=0), sample_docs(teacher, 16, SEQ, 1))
    return target, teacher, data


def test_an_exact_fused_draft_has_zero_loss_at_every_unroll_step():
    """The fused oracle reads [f + u, u, 2u] and its fuse recovers f: training's step 0
    conditions the target's features, the later steps feed its own h as it is."""
    target = PreviousTokenTarget()
    ids = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(0))
    for with_feature, zero in ((True, True), (False, False)):
        draft = oracle_draft(target, with_feature, fused=True)
        t_logits, t_features = teacher_outputs(target, draft, ids)
        assert t_features.shape[-1] == 3 * draft.config.hidden_size
        with torch.no_grad():
            losses = unrolled_losses(draft, ids, t_logits, t_features, settings(ttt_steps=3))
        assert all((float(loss) < 1e-6) == zero for loss in losses), losses


def test_an_exact_fused_draft_is_accepted_everywhere_offline():
    g = torch.Generator().manual_seed(1)
    docs = Docs()
    for n in (40, 25, 33):
        docs.add(torch.randint(0, V, (n,), generator=g).tolist(), 1, "random-target-samples")
    target = PreviousTokenTarget()
    draft = oracle_draft(target, fused=True)
    assert draft.feature.layers == FUSED_LAYERS
    for r in acceptance_rows(draft, target, docs, k=4, positions=20, seed=0):
        assert r["accepted"] == r["tried"] == 20 * 4, r


def test_cli_trains_a_fused_draft_that_loads_and_evaluates(setup, tmp_path, capsys):
    from tools.distill import feature_eval

    target, _, data = setup
    out = tmp_path / "draft"
    report = main(["--target", target, "--out", str(out), "--data-from", data, "--device", "cpu",
                   "--steps", "30", "--batch", "8", "--seq-len", str(SEQ), "--eval-every", "15",
                   "--ttt-steps", "2", "--lr", "3e-3", "--features", "fused"])
    history = report["history"]
    assert history[-1]["kl"][0] < 0.7 * history[0]["kl"][0], history
    assert report["args"]["features"] == "fused" and report["args"]["fused_layers"] == [1, 2, 3]
    assert "fused features of layers [1, 2, 3]" in capsys.readouterr().out
    with open(out / "config.json") as f:
        assert json.load(f)["ssdlib_feature_draft"] == {"target_hidden_size": 64,
                                                        "feature": "fused", "layers": [1, 2, 3]}
    assert load_file(str(out / "model.safetensors"))["fuse.weight"].shape == (64, 192)
    draft = load_feature_draft(str(out), load_checkpoint(target))
    assert draft.feature == FeatureSpec("fused", (1, 2, 3))
    rows = feature_eval.main(["--draft", str(out), "--target", target, "--data-from", data,
                              "--k", "3", "--positions", "8"])
    assert [r["positions"] for r in rows] == [8, 8]


def test_cli_fused_layers_init_from_and_refusals(setup, tmp_path):
    target, _, data = setup
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--batch", "4",
              "--seq-len", str(SEQ), "--eval-every", "0", "--eval-batch", "4"]
    first = tmp_path / "first"
    main(common + ["--out", str(first), "--steps", "3", "--features", "fused",
                   "--fused-layers", "0,2,3"])
    second = main(common + ["--out", str(tmp_path / "second"), "--steps", "3",
                            "--init-from", str(first)])  # keeps the kind and the layers
    assert second["args"]["features"] == "fused" and second["args"]["fused_layers"] == [0, 2, 3]
    ck = load_checkpoint(target)
    assert load_feature_draft(str(tmp_path / "second"), ck).feature.layers == (0, 2, 3)
    for extra, match in (
            (["--init-from", str(first), "--features", "last"], "keeps them"),
            (["--init-from", str(first), "--features", "fused"], "keeps them"),  # 1,2,3
            (["--features", "fused", "--fused-layers", "1,2,9"], "target has 4 decoder layers"),
            (["--features", "fused", "--fused-layers", "1,x,3"], "must be integers"),
            (["--features", "fused", "--fused-layers", "3,2,1"], "increasing"),
            (["--fused-layers", "1,2,3"], "goes with --features fused")):
        with pytest.raises(SystemExit, match=match):
            main(common + ["--out", str(tmp_path / "x"), "--steps", "1", *extra])


def test_the_size_limit_counts_fuse(setup, tmp_path):
    target, teacher, data = setup
    plain = stored_mb(FeatureDraft.for_target(teacher, 1), torch.float16)
    fused = stored_mb(FeatureDraft.for_target(teacher, 1, feature=FeatureSpec.fused(4)),
                      torch.float16)
    limit = f"{(plain + fused) / 2:.6f}"
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--batch", "4",
              "--seq-len", str(SEQ), "--eval-every", "0", "--steps", "1", "--max-mb", limit]
    main(common + ["--out", str(tmp_path / "plain")])
    with pytest.raises(SystemExit, match="more than the limit"):
        main(common + ["--out", str(tmp_path / "fused"), "--features", "fused"])


def test_a_stopped_fused_run_resumes_with_its_layers(setup, tmp_path):
    """--resume of a fused draft's run: the kind and the layers come from the stopped run, and
    the draft it writes is the uninterrupted run's, tensor for tensor."""
    target, _, data = setup
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--batch", "4",
              "--seq-len", str(SEQ), "--eval-every", "0", "--eval-batch", "4", "--steps", "6",
              "--features", "fused", "--fused-layers", "0,2,3"]
    main(common + ["--out", str(tmp_path / "whole")])
    main(common + ["--out", str(tmp_path / "split"), "--stop-after-steps", "3"])
    b = main(["--resume", "--work-dir", str(tmp_path / "split.work"),
              "--out", str(tmp_path / "split")])
    assert b["args"]["fused_layers"] == [0, 2, 3] and b["history"][-1]["step"] == 6
    wa = load_file(str(tmp_path / "whole" / "model.safetensors"))
    wb = load_file(str(tmp_path / "split" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
