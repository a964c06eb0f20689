"""Training a feature draft over a draft vocabulary (tools/distill_feature_draft.py
--draft-vocab N, tools/distill/feature_train.py DraftVocab) on a tiny random target (CPU): the
draft's logits over the vocabulary are the full head's at those tokens, training lowers the KL
over them, held-out agreement is with the target's token over the whole vocabulary, and the CLI
writes the ranking and the trained size, which the engine's default then takes."""

import json

import pytest
import torch

from ssdlib.engine_config import EngineConfig
from ssdlib.loading import load_checkpoint
from ssdlib.loading.draft_vocab import TRAINED_VOCAB_KEY, ranking_path, read_ranking
from ssdlib.loading.feature_draft import load_feature_draft
from ssdlib.models.feature_draft import FeatureDraft
from tests.tools.test_feature_draft_train import SEQ, settings, setup  # noqa: F401 (fixture)
from tools.distill.data import Batcher, load_splits, pack_rows
from tools.distill.feature_train import (DraftVocab, FeatureTrainer, evaluate_unrolled,
                                         init_feature_draft, teacher_outputs)
from tools.distill_feature_draft import main


def _draft(teacher):
    draft = FeatureDraft.for_target(teacher, layers=1)
    init_feature_draft(draft, teacher, seed=0)
    return draft


def test_the_vocabularys_logits_are_the_full_heads_at_its_tokens(setup):  # noqa: F811
    _, teacher, _ = setup
    draft = _draft(teacher)
    ids = torch.tensor([3, 17, 40, 41, 90])
    vocab = DraftVocab(draft, ids)
    h = torch.randn(2, 4, draft.config.hidden_size)
    torch.testing.assert_close(vocab.view.logits(h), draft.logits(h)[..., ids])
    full = torch.randn(2, 4, draft.config.vocab_size)
    assert torch.equal(vocab.of_target(full), full[..., ids])
    assert vocab.token(torch.tensor([0, 4])).tolist() == [3, 90]
    assert set(dict(vocab.view.named_parameters())) == set(dict(draft.named_parameters()))


def _trainer(setup, token_ids, steps=60):  # noqa: F811
    _, teacher, data = setup
    train_docs, held_out = load_splits(data)
    batcher = Batcher(pack_rows(train_docs, SEQ, 0, None), 8, 0)
    return FeatureTrainer(_draft(teacher), teacher, batcher, held_out,
                          settings(steps=steps, ttt_steps=2), token_ids)


def _teacher_argmax_tokens(setup) -> set[int]:  # noqa: F811
    """The target's greedy tokens at the held-out positions evaluation scores."""
    _, teacher, data = setup
    _, held_out = load_splits(data)
    out = set()
    for ids, start in zip(held_out.ids, held_out.score_from):
        logits, _ = teacher_outputs(teacher, _draft(teacher), torch.tensor([ids]))
        out |= set(logits[0, max(start - 1, 0):].argmax(-1).tolist())
    return out


def test_training_over_a_vocabulary_lowers_its_kl(setup):  # noqa: F811
    vocab_size = setup[1].config.vocab_size
    ids = torch.arange(0, vocab_size, 2)  # half the tokens
    history = _trainer(setup, ids).run()
    assert history[-1]["kl"][0] < 0.7 * history[0]["kl"][0], history
    assert all(0.0 <= a <= 1.0 for a in history[-1]["agreement"])


def test_agreement_is_with_the_targets_token_over_the_whole_vocabulary(setup):  # noqa: F811
    """A vocabulary without any of the target's greedy tokens never agrees; the KL over it is
    still defined (the target's distribution renormalised there)."""
    vocab_size = setup[1].config.vocab_size
    greedy = _teacher_argmax_tokens(setup)
    others = torch.tensor([t for t in range(vocab_size) if t not in greedy])
    assert 0 < others.numel() < vocab_size
    trainer = _trainer(setup, others, steps=0)
    result = evaluate_unrolled(trainer.view, trainer.teacher, trainer.held_out, trainer.s,
                               trainer.vocab)
    assert result["agreement"] == [0.0] * trainer.s.eval_depth
    assert all(k == k and k >= 0 for k in result["kl"])  # finite, not NaN
    everything = _trainer(setup, torch.arange(vocab_size), steps=0)
    full = evaluate_unrolled(everything.view, everything.teacher, everything.held_out,
                             everything.s, everything.vocab)
    plain = evaluate_unrolled(everything.draft, everything.teacher, everything.held_out,
                              everything.s)
    assert full["agreement"] == plain["agreement"]
    assert full["kl"] == pytest.approx(plain["kl"], rel=1e-5)


def test_cli_writes_the_ranking_and_the_size_the_engine_then_takes(setup, tmp_path):  # noqa: F811
    target, _, data = setup
    out = tmp_path / "draft"
    report = main(["--target", target, "--out", str(out), "--data-from", data, "--device", "cpu",
                   "--steps", "20", "--batch", "8", "--seq-len", str(SEQ), "--eval-every", "10",
                   "--ttt-steps", "2", "--lr", "3e-3", "--draft-vocab", "40"])
    assert report["args"]["draft_vocab"] == 40
    assert report["history"][-1]["kl"][0] < report["history"][0]["kl"][0]
    with open(out / "config.json") as f:
        assert json.load(f)[TRAINED_VOCAB_KEY] == 40
    ck = load_checkpoint(target)
    ranked = read_ranking(ranking_path(str(out)), ck.config.vocab_size)
    assert ranked.numel() >= 40
    load_feature_draft(str(out), ck)
    cfg = EngineConfig(target=target, draft=str(out), mode="sd", device="cpu")
    assert cfg.draft_vocab == 40  # the trained size, not the CPU's default 16384
    assert cfg.draft_vocab_ids(ck.config.vocab_size, ck.config.eos_token_ids).numel() >= 40
    with pytest.raises(SystemExit, match="--draft-vocab 100000: the training data ranks"):
        main(["--target", target, "--out", str(tmp_path / "x"), "--data-from", data,
              "--device", "cpu", "--steps", "1", "--draft-vocab", "100000"])


def test_a_stopped_run_over_a_vocabulary_resumes_over_it(setup, tmp_path):  # noqa: F811
    target, _, data = setup
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--steps", "12",
              "--batch", "8", "--seq-len", str(SEQ), "--eval-every", "6", "--ttt-steps", "2",
              "--lr", "3e-3", "--draft-vocab", "40"]
    whole = main([*common, "--out", str(tmp_path / "whole")])
    main([*common, "--out", str(tmp_path / "split"), "--stop-after-steps", "6"])
    resumed = main(["--resume", "--work-dir", str(tmp_path / "split.work"), "--out",
                    str(tmp_path / "split")])
    assert resumed["args"]["draft_vocab"] == 40
    assert resumed["history"][-1]["kl"] == pytest.approx(whole["history"][-1]["kl"], rel=1e-4)
    with open(tmp_path / "split" / "config.json") as f:
        assert json.load(f)[TRAINED_VOCAB_KEY] == 40


def test_the_evaluators_measure_a_draft_with_the_vocabulary_it_was_trained_over(
        setup, tmp_path, capsys):  # noqa: F811
    from tools.distill import evaluate, feature_eval

    target, _, data = setup
    out = tmp_path / "draft"
    main(["--target", target, "--out", str(out), "--data-from", data, "--device", "cpu",
          "--steps", "4", "--batch", "8", "--seq-len", str(SEQ), "--eval-every", "0",
          "--ttt-steps", "1", "--draft-vocab", "30"])
    assert evaluate.trained_vocab(str(out)) == 30 and evaluate.trained_vocab(target) == "full"
    args = ["--draft", str(out), "--target", target, "--data-from", data, "--k", "3",
            "--positions", "8"]
    capsys.readouterr()
    feature_eval.main(args)
    assert "draft vocabulary 30" in capsys.readouterr().out
    feature_eval.main([*args, "--draft-vocab", "full"])
    assert "draft vocabulary" not in capsys.readouterr().out
