"""Feature draft training (tools/distill/feature_train.py, tools/distill_feature_draft.py) on a
tiny random target (CPU): the losses are aligned (zero for an exact draft, at every unroll
step), unroll step j reads step j-1's outputs one position on, training lowers the held-out KL,
self-conditioned training narrows the gap between the target's features and the draft's own,
the token gain lets the draft learn the token next to outsized features, and the CLI writes a
draft that loads and evaluates."""

import json
import os
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn.utils import parametrize

from ssdlib.config import ModelConfig
from ssdlib.loading import load_checkpoint
from ssdlib.loading.feature_draft import load_feature_draft
from ssdlib.models.feature_draft import FeatureDraft
from tests.feature_oracle import H, V, PreviousTokenTarget, oracle_draft
from tests.tiny import make_tiny_llama
from tools.distill.data import Batcher, Docs, load_splits, pack_rows, save_splits
from tools.distill.feature_train import (FeatureTrainer, FeatureTrainSettings, compiled_kl,
                                         grow_feature_draft, inference_keys_mask,
                                         init_feature_draft, token_gain_for, unroll,
                                         unrolled_losses)
from tools.distill.train import kl_from_log_probs, teacher_log_probs
from tools.distill.models import load_teacher
from tools.distill_feature_draft import main

SEQ = 48


def sample_docs(model, n: int, length: int, seed: int) -> Docs:
    """``n`` documents: 2 random ids, then ``length`` tokens the target samples (temperature 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (n, 2), generator=g)
    with torch.no_grad():
        for _ in range(length):
            probs = torch.softmax(model.forward_full(ids)[:, -1], dim=-1)
            ids = torch.cat([ids, torch.multinomial(probs, 1, generator=g)], dim=1)
    docs = Docs()
    for row in ids.tolist():
        docs.add(row, 2, "random-target-samples")
    return docs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, its teacher model, and data.safetensors of target samples."""
    root = tmp_path_factory.mktemp("feature_train")
    target = make_tiny_llama(str(root / "target"), "gqa", scale=2.0)
    teacher = load_teacher(load_checkpoint(target), torch.device("cpu"), torch.float32, 256)
    data = str(root / "data.safetensors")
    save_splits(data, sample_docs(teacher, 96, SEQ, seed=0), sample_docs(teacher, 16, SEQ, 1))
    return target, teacher, data


def settings(**kw) -> FeatureTrainSettings:
    base = dict(steps=60, lr=3e-3, warmup=3, seq_len=SEQ, eval_batch=16, eval_every=0,
                eval_depth=4)
    return FeatureTrainSettings(**{**base, **kw})


def test_an_exact_draft_has_zero_loss_at_every_unroll_step():
    """Alignment of the training targets: the oracle's logits at t are the target's at t + 1 and
    its hidden h_t is f_{t+1}, and its own features are exact, so every step's loss vanishes."""
    target = PreviousTokenTarget()
    ids = torch.randint(0, V, (3, 20), generator=torch.Generator().manual_seed(0))
    t_logits, t_features = target.forward_full_features(ids)
    for draft, zero in ((oracle_draft(target), True), (oracle_draft(target, False), False)):
        with torch.no_grad():
            losses = unrolled_losses(draft, ids, t_logits, t_features, settings(ttt_steps=3))
        assert len(losses) == 3
        assert all((float(loss) < 1e-6) == zero for loss in losses), losses


def test_unroll_step_j_reads_step_j_minus_1_one_position_on(setup):
    _, teacher, _ = setup
    draft = FeatureDraft.for_target(teacher, layers=1)
    init_feature_draft(draft, teacher, seed=0)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 12),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        features = teacher.forward_full_features(ids)[1][:, :-1]
        steps = list(unroll(draft, features, ids[:, 1:], 3))
        expected = draft.forward_full(features, ids[:, 1:])
        for logits, hidden in steps:
            assert torch.equal(logits, expected[0]) and torch.equal(hidden, expected[1])
            own = torch.cat([features[:, :1], hidden[:, :-1]], dim=1)
            expected = draft.forward_full(own, ids[:, 1:])


def test_an_inference_keyed_unroll_step_is_the_draft_at_inference(setup):
    """unroll(keys="inference"): step j at position t is the draft as it runs at inference with
    the target's features up to position e = max(t - j, 0) and its own h after, one position
    at a time (a cache-free rollout), for a draft of two layers; step 0 is the plain forward;
    the uniform keys differ from it past step 0."""
    _, teacher, _ = setup
    draft = FeatureDraft.for_target(teacher, layers=2)
    init_feature_draft(draft, teacher, seed=2)
    s = 9
    ids = torch.randint(0, teacher.config.vocab_size, (2, s + 1),
                        generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        features = teacher.forward_full_features(ids)[1][:, :-1]
        next_ids = ids[:, 1:]
        steps = list(unroll(draft, features, next_ids, 4, keys="inference"))
        uniform = list(unroll(draft, features, next_ids, 4, keys="uniform"))
        f = draft.condition(features)
        torch.testing.assert_close(steps[0][0], draft.forward_full(f, next_ids)[0])
        for j, (logits, hidden) in enumerate(steps):
            for t in range(s):
                e = max(t - j, 0)
                feats = f[:, :e + 1]
                for p in range(e + 1, t + 1):  # the draft's own h stands in for f_p
                    h = draft.forward_full(feats, next_ids[:, :p])[1][:, -1:]
                    feats = torch.cat([feats, h], dim=1)
                want_logits, want_hidden = draft.forward_full(feats, next_ids[:, :t + 1])
                torch.testing.assert_close(logits[:, t], want_logits[:, -1], atol=2e-5,
                                           rtol=1e-5)
                torch.testing.assert_close(hidden[:, t], want_hidden[:, -1], atol=2e-5,
                                           rtol=1e-5)
        assert not torch.allclose(uniform[2][0], steps[2][0], atol=1e-3)
    with pytest.raises(ValueError, match="unroll keys"):
        next(unroll(draft, features, next_ids, 2, keys="other"))


def test_the_inference_keys_masks_of_steps_0_and_1():
    """Step 0 is causal; step 1's query at t sees step 0's keys up to t - 1 and its own at t; at
    t = 0 it is position 0's (the target's feature: step 0's key)."""
    cpu = torch.device("cpu")
    assert inference_keys_mask(3, 0, cpu).int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert inference_keys_mask(3, 1, cpu).int().tolist() == [
        [1, 0, 0, 0, 0, 0],   # t = 0: position 0 from step 0
        [1, 0, 0, 0, 1, 0],   # t = 1: step 0 up to 0, then its own
        [1, 1, 0, 0, 0, 1]]   # t = 2: step 0 up to 1, then its own


def test_the_kl_from_log_probs_and_its_compiled_form_match_the_plain_reference(setup):
    """The training KL (the teacher's log-probabilities computed once) equals torch's kl_div on
    the two log-softmaxes, and so does its torch.compile form, value and gradient; the unrolled
    losses are the same with the compiled KL."""
    g = torch.Generator().manual_seed(0)
    d, t = torch.randn(3, 7, 40, generator=g), 3 * torch.randn(3, 7, 40, generator=g)
    reference = torch.nn.functional.kl_div(d.log_softmax(-1), t.log_softmax(-1),
                                           log_target=True, reduction="none").sum(-1)
    grads = []
    for kl in (kl_from_log_probs, compiled_kl()):
        x = d.clone().requires_grad_(True)
        value = kl(x, teacher_log_probs(t))
        assert torch.allclose(value, reference, atol=1e-5), kl
        (value * torch.arange(7.0)).sum().backward()
        grads.append(x.grad)
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    assert not torch.equal(grads[0], torch.zeros_like(grads[0]))
    _, teacher, _ = setup
    draft = FeatureDraft.for_target(teacher, layers=1)
    init_feature_draft(draft, teacher, seed=0)
    ids = torch.randint(0, teacher.config.vocab_size, (2, 12), generator=g)
    with torch.no_grad():
        t_logits, t_features = teacher.forward_full_features(ids)
        plain, fused = (unrolled_losses(draft, ids, t_logits, t_features,
                                        settings(ttt_steps=2, compile_loss=c))
                        for c in (False, True))
        assert torch.allclose(torch.stack(plain), torch.stack(fused), atol=1e-5)


def train(setup, ttt_steps: int, steps: int = 60) -> list[dict]:
    _, teacher, data = setup
    train_docs, held_out = load_splits(data)
    batcher = Batcher(pack_rows(train_docs, SEQ, 0, None), 8, 0)
    draft = FeatureDraft.for_target(teacher, layers=1)
    init_feature_draft(draft, teacher, seed=0)
    trainer = FeatureTrainer(draft, teacher, batcher, held_out,
                             settings(steps=steps, ttt_steps=ttt_steps))
    return trainer.run()


def test_self_conditioned_training_narrows_the_gap(setup):
    """Same data, seed and steps: trained with 3 unroll steps, the draft's held-out KL on its own
    features (depth 3) is lower, and much closer to its KL on the target's features (depth 0),
    than trained on the target's features only."""
    plain, ttt = train(setup, ttt_steps=1)[-1], train(setup, ttt_steps=3)[-1]
    gap_plain = plain["kl"][3] - plain["kl"][0]
    gap_ttt = ttt["kl"][3] - ttt["kl"][0]
    assert gap_plain > 0.1, plain
    assert gap_ttt < 0.5 * gap_plain, (plain, ttt)
    assert ttt["kl"][3] < plain["kl"][3], (plain, ttt)


def test_cli_trains_writes_and_evaluates(setup, tmp_path, capsys):
    from tools.distill import feature_eval

    target, _, data = setup
    out = tmp_path / "draft"
    report = main(["--target", target, "--out", str(out), "--data-from", data, "--device", "cpu",
                   "--steps", "30", "--batch", "8", "--seq-len", str(SEQ), "--eval-every", "15",
                   "--ttt-steps", "2", "--lr", "3e-3", "--init-layer-from-target", "1"])
    history = report["history"]
    assert report["token_gain"] > 0  # measured (--token-gain auto)
    assert [h["step"] for h in history] == [0, 15, 30]
    assert history[-1]["kl"][0] < 0.7 * history[0]["kl"][0], history
    tensors = load_file(str(out / "model.safetensors"))
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert not any("embed" in n or "lm_head" in n for n in tensors)
    with open(out / "feature_distill.json") as f:
        assert json.load(f)["history"][-1]["step"] == 30
    load_feature_draft(str(out), load_checkpoint(target))

    rows = feature_eval.main(["--draft", str(out), "--target", target, "--data-from", data,
                              "--k", "3", "--positions", "12"])
    assert [r["positions"] for r in rows] == [12, 12]
    assert all(0.0 <= r["a_p"] <= 1.0 and r["tried"] >= 12 for r in rows)
    assert "| self-conditioned | 4 | 12 |" in capsys.readouterr().out


def test_size_limit_is_checked_before_training(setup, tmp_path):
    target, _, data = setup
    with pytest.raises(SystemExit, match="more than the limit of 0.01 MB"):
        main(["--target", target, "--out", str(tmp_path / "x"), "--data-from", data,
              "--device", "cpu", "--seq-len", str(SEQ), "--batch", "8", "--max-mb", "0.01"])
    assert not os.path.exists(tmp_path / "x")


def test_a_time_budget_cuts_the_steps_and_still_ends_on_an_evaluation(setup):
    """FeatureTrainer under a StepBudget whose clock says each step takes 1 s: the step count is
    cut once to what fits, the schedule ends there, and the last evaluation is at that step."""
    from tools.distill.budget import StepBudget

    target, model, data = setup
    train_docs, held_out = load_splits(data)
    draft = FeatureDraft.for_target(model, 1)
    init_feature_draft(draft, model, 0)
    batcher = Batcher(pack_rows(train_docs, SEQ, 0, None), 4, 0)
    trainer = FeatureTrainer(draft, model, batcher, held_out, settings(steps=100, eval_every=0))
    ticks = {"t": 0.0}

    def clock():  # one second a call: before_step calls it once a step
        ticks["t"] += 1.0
        return ticks["t"]
    budget = StepBudget(30.0, start=0.0, calibrate=5, skip=1, reserve=0.0, clock=clock)
    history = trainer.run(budget=budget)
    assert budget.report is not None and budget.report["steps"] < 100
    assert trainer.step == trainer.s.steps == budget.report["steps"]
    assert history[-1]["step"] == trainer.step


def test_cli_trains_on_long_rows_too(setup, tmp_path, capsys, monkeypatch):
    """--long-seq-len: short and long rows in turn (positions past --seq-len trained)."""
    from tools.distill import feature_train

    target, _, data = setup
    shapes = []
    train_on = feature_train.FeatureTrainer.train_on

    def recording(self, ids):
        shapes.append(tuple(ids.shape))
        return train_on(self, ids)
    monkeypatch.setattr(feature_train.FeatureTrainer, "train_on", recording)
    report = main(["--target", target, "--out", str(tmp_path / "d"), "--data-from", data,
                   "--device", "cpu", "--steps", "4", "--batch", "4", "--seq-len", "24",
                   "--long-seq-len", str(SEQ * 2), "--long-every", "2", "--eval-every", "0"])
    assert report["history"][-1]["step"] == 4
    assert shapes == [(4, 24), (1, 96)] * 2  # a long batch: as many tokens as a short one
    assert f"rows of {SEQ * 2} every 2 batches" in capsys.readouterr().out


class ScaledFeatures(nn.Module):
    """PreviousTokenTarget with its features times ``scale`` (its logits unchanged: the norm
    takes the scale out), as outsized against the embeddings as a real target's pre-norm
    features (SmolLM2-135M: RMS ~32 against ~0.12)."""

    def __init__(self, scale: float):
        super().__init__()
        self.base, self.scale = PreviousTokenTarget(), scale
        self.model = SimpleNamespace(layers=[], norm=self.base.norm)  # for init_feature_draft

    def forward_full_features(self, ids):
        logits, features = self.base.forward_full_features(ids)
        return logits, features * self.scale


def random_docs(n: int, seed: int) -> Docs:
    g = torch.Generator().manual_seed(seed)
    docs = Docs()
    for _ in range(n):
        docs.add(torch.randint(0, V, (SEQ,), generator=g).tolist(), 1, "random-target-samples")
    return docs


def test_the_token_gain_is_the_feature_to_embedding_ratio():
    ids = torch.randint(0, V, (4, SEQ), generator=torch.Generator().manual_seed(0))
    gains = []
    for scale in (1.0, 80.0):
        target = ScaledFeatures(scale)
        gains.append(token_gain_for(oracle_draft(target.base), target, ids))
    assert 1.0 < gains[0] < 10.0
    assert gains[1] == pytest.approx(80.0 * gains[0], rel=1e-4)


def test_the_token_gain_lets_the_draft_learn_the_token_next_to_outsized_features():
    """The target's next argmax is an exact linear function of (f_t, x_{t+1}), its features
    ~270x its embeddings' RMS. Trained plainly, fc's token columns start ~270x weaker than its
    feature columns and AdamW grows them slowly: the draft still misses many tokens. Through
    the token gain (the same steps) it is exact, and it leaves as it is stored: a plain fc."""
    target = ScaledFeatures(80.0)
    train_docs, held_out = random_docs(128, 1), random_docs(32, 2)
    gain = token_gain_for(oracle_draft(target.base), target, torch.tensor(train_docs.ids[:8]))
    assert gain > 200
    cfg = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                      embedding_from_target=True)
    agreement = {}
    for c in (1.0, gain):
        draft = FeatureDraft(cfg, target.base.embed_tokens, target.base.lm_head, 128)
        init_feature_draft(draft, target, seed=0, token_gain=c)
        names, fc_weight = set(draft.stored_tensors()), draft.fc.weight
        s = settings(steps=300, ttt_steps=1, eval_depth=1, eval_batch=32, warmup=10, token_gain=c,
                     feature_loss_weight=0.0)
        trainer = FeatureTrainer(draft, target, Batcher(pack_rows(train_docs, SEQ, 0, None), 16, 0),
                                 held_out, s)
        agreement[c] = trainer.run()[-1]["agreement"][0]
        assert not parametrize.is_parametrized(draft.fc)
        assert draft.fc.weight is fc_weight and set(draft.stored_tensors()) == names
    assert agreement[gain] > 0.97, agreement
    assert agreement[1.0] < 0.9, agreement


def test_cli_continues_a_draft_it_wrote(setup, tmp_path):
    """--init-from: a second run starts from the first one's draft (its first evaluation is the
    first run's last, up to the fp16 storage) and trains on from there."""
    target, _, data = setup
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--batch", "8",
              "--seq-len", str(SEQ), "--ttt-steps", "2", "--lr", "3e-3", "--eval-every", "0"]
    a = main(common + ["--out", str(first), "--steps", "20", "--layers", "2"])["history"]
    b = main(common + ["--out", str(second), "--steps", "20", "--init-from", str(first)])
    assert b["history"][0]["kl"][0] == pytest.approx(a[-1]["kl"][0], rel=0.02)
    assert b["history"][-1]["kl"][0] < b["history"][0]["kl"][0]
    assert len(load_feature_draft(str(second), load_checkpoint(target)).layers) == 2
    with pytest.raises(SystemExit, match="exclude each other"):
        main(common + ["--out", str(tmp_path / "x"), "--steps", "2", "--init-from", str(first),
                       "--init-layer-from-target", "0"])


def test_a_stopped_run_goes_on_with_resume_as_if_it_had_not_stopped(setup, tmp_path, capsys):
    """--stop-after-steps ends a call early, keeping the run's state; --resume goes on with the
    same schedule, optimizer and data order: the draft it writes is the uninterrupted run's,
    tensor for tensor (CPU, float32; the token gain included; fused features:
    tests/tools/test_fused_feature_train.py)."""
    target, _, data = setup
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--batch", "4",
              "--seq-len", str(SEQ), "--ttt-steps", "2", "--lr", "3e-3", "--eval-every", "0",
              "--steps", "9", "--warmup", "3", "--init-layer-from-target", "1"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    a = main(common + ["--out", str(whole)])
    first = main(common + ["--out", str(split), "--stop-after-steps", "4"])
    assert [h["step"] for h in first["history"]] == [0, 4]
    assert "go on with --resume" in capsys.readouterr().out
    assert os.path.isfile(tmp_path / "split.work" / "state.pt")
    b = main(["--resume", "--work-dir", str(tmp_path / "split.work"), "--out", str(split),
              "--device", "cpu"])
    assert "resumed at step 4 of 9" in capsys.readouterr().out
    assert [h["step"] for h in b["history"]] == [0, 4, 9]
    assert b["history"][-1] == a["history"][-1]
    assert len(b["commands"]) == 2 and b["args"]["steps"] == 9
    assert not os.path.exists(tmp_path / "split.work" / "state.pt")  # complete: nothing to resume
    wa, wb = load_file(str(whole / "model.safetensors")), load_file(str(split / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    with pytest.raises(SystemExit, match="no stopped run"):
        main(["--resume", "--work-dir", str(tmp_path / "nothing"), "--out", str(split)])


def test_resume_refuses_other_data(setup, tmp_path):
    target, teacher, data = setup
    common = ["--target", target, "--device", "cpu", "--batch", "4", "--seq-len", str(SEQ),
              "--ttt-steps", "1", "--eval-every", "0", "--steps", "6"]
    first = tmp_path / "d"
    main(common + ["--data-from", data, "--out", str(first), "--stop-after-steps", "2"])
    other = str(tmp_path / "other.safetensors")
    save_splits(other, sample_docs(teacher, 48, SEQ, seed=5), sample_docs(teacher, 8, SEQ, 6))
    run = json.loads((tmp_path / "d.work" / "run.json").read_text())
    run["args"]["data_from"] = other  # as if the data file had been replaced
    (tmp_path / "d.work" / "run.json").write_text(json.dumps(run))
    with pytest.raises(SystemExit, match="not the same data"):
        main(["--resume", "--work-dir", str(tmp_path / "d.work"), "--out", str(first)])
    with pytest.raises(SystemExit, match="--stop-after-steps must be positive"):
        main(common + ["--data-from", data, "--out", str(tmp_path / "x"),
                       "--stop-after-steps", "0"])


def test_a_grown_draft_starts_computing_what_it_grew_from(setup):
    """grow_feature_draft: the new layers (zero output projections) add nothing, at every unroll
    depth; they start as the draft's last layer, or as the named target layer; the old weights
    are kept."""
    _, teacher, _ = setup
    draft = FeatureDraft.for_target(teacher, 1)
    init_feature_draft(draft, teacher, seed=3)
    with torch.no_grad():  # a trained-looking draft: its layer no longer the init
        for p in draft.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(4)))
    grown = grow_feature_draft(draft, teacher, 2)
    assert len(grown.layers) == 3
    ids = torch.randint(0, teacher.config.vocab_size, (2, SEQ),
                        generator=torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(6)
    features = 4 * torch.randn(2, SEQ - 1, draft.feature_width, generator=g)
    with torch.no_grad():
        for (la, ha), (lb, hb) in zip(unroll(draft, features, ids[:, 1:], 3),
                                      unroll(grown, features, ids[:, 1:], 3)):
            torch.testing.assert_close(lb, la, rtol=0, atol=0)
            torch.testing.assert_close(hb, ha, rtol=0, atol=0)
    assert torch.equal(grown.layers[0].self_attn.qkv_proj.weight,
                       draft.layers[0].self_attn.qkv_proj.weight)
    assert torch.equal(grown.layers[2].mlp.gate_up_proj.weight,
                       draft.layers[0].mlp.gate_up_proj.weight)
    assert not grown.layers[1].self_attn.o_proj.weight.any()
    assert not grown.layers[2].mlp.down_proj.weight.any()
    from_target = grow_feature_draft(draft, teacher, 1, init_layer=0)
    assert torch.equal(from_target.layers[1].self_attn.qkv_proj.weight,
                       teacher.model.layers[0].self_attn.qkv_proj.weight)
    with pytest.raises(ValueError, match="at least 1"):
        grow_feature_draft(draft, teacher, 0)


def test_cli_grows_a_draft_it_wrote(setup, tmp_path):
    """--init-from DIR --grow-layers 1: the deeper draft's first evaluation is DIR's last (up to
    the fp16 storage), it trains on from there and is written with one layer more."""
    target, _, data = setup
    first, second = tmp_path / "first", tmp_path / "second"
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--batch", "8",
              "--seq-len", str(SEQ), "--ttt-steps", "2", "--lr", "3e-3", "--eval-every", "0"]
    a = main(common + ["--out", str(first), "--steps", "20"])["history"]
    b = main(common + ["--out", str(second), "--steps", "20", "--init-from", str(first),
                       "--grow-layers", "1"])
    assert b["args"]["layers"] == 2
    assert b["history"][0]["kl"][0] == pytest.approx(a[-1]["kl"][0], rel=0.02)
    assert b["history"][-1]["kl"][0] < b["history"][0]["kl"][0]
    assert len(load_feature_draft(str(second), load_checkpoint(target)).layers) == 2
    # a grown run stopped and resumed is the uninterrupted grown run (its shape from the record)
    grow = common + ["--steps", "8", "--init-from", str(first), "--grow-layers", "1"]
    whole = main(grow + ["--out", str(tmp_path / "whole")])
    main(grow + ["--out", str(tmp_path / "split"), "--stop-after-steps", "3"])
    resumed = main(["--resume", "--work-dir", str(tmp_path / "split.work"), "--out",
                    str(tmp_path / "split"), "--device", "cpu"])
    assert resumed["history"][-1] == whole["history"][-1]
    assert resumed["args"]["layers"] == 2
    with pytest.raises(SystemExit, match="grows the draft of --init-from"):
        main(common + ["--out", str(tmp_path / "x"), "--steps", "2", "--grow-layers", "1"])
    with pytest.raises(SystemExit, match="at least 1"):
        main(common + ["--out", str(tmp_path / "x"), "--steps", "2", "--init-from", str(first),
                       "--grow-layers", "0"])


def test_a_run_recorded_before_ttt_keys_resumes_with_uniform_keys(setup, tmp_path):
    """--ttt-keys is recorded with the run; a stopped run whose record predates it (no such
    key) resumes with the uniform keys it was trained with."""
    target, _, data = setup
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--batch", "4",
              "--seq-len", str(SEQ), "--ttt-steps", "2", "--eval-every", "0", "--steps", "4"]
    first = main(common + ["--out", str(tmp_path / "d"), "--stop-after-steps", "2"])
    assert first["args"]["ttt_keys"] == "inference"
    run_path = tmp_path / "d.work" / "run.json"
    run = json.loads(run_path.read_text())
    del run["args"]["ttt_keys"]
    run_path.write_text(json.dumps(run))
    resumed = main(["--resume", "--work-dir", str(tmp_path / "d.work"), "--out",
                    str(tmp_path / "d"), "--device", "cpu"])
    assert resumed["args"]["ttt_keys"] == "uniform"
