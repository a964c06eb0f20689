"""tools/distill_many.py: drafts trained in lockstep on one teacher forward per batch end
exactly where each ends trained alone by distill_draft.py, resume together, and refuse what
they cannot share."""

import os

import pytest
import torch
from safetensors.torch import load_file

from tests.tiny import make_tiny_llama
from tools.distill.lockstep import check_lockstep
from tools.distill_draft import main as distill_main
from tools.distill_many import main

DRAFT = ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "64"]
# the two candidates differ in shape, loss, learning rate and steps
CANDS = {"a": [*DRAFT, "--lr", "1e-2"],
         "b": ["--hidden", "48", "--layers", "2", "--heads", "2", "--kv-heads", "1", "--ffn",
               "64", "--loss", "tvd", "--lr", "5e-3", "--steps", "4"]}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("many")
    target = make_tiny_llama(str(root / "target"), "gqa", scale=2.0)
    distill_main(["--target", target, "--out", str(root / "data_run"), "--device", "cpu",
                  "--seq-len", "48", "--batch", "8", "--eval-samples", "16", "--eval-batch",
                  "16", *DRAFT, "--data", "random-target-samples", "--random-samples", "64",
                  "--random-len", "48", "--steps", "0"])
    data = str(root / "data_run.work" / "data.safetensors")
    common = ["--target", target, "--data-from", data, "--device", "cpu", "--seq-len", "48",
              "--batch", "8", "--eval-batch", "16", "--eval-every", "3", "--save-every", "3",
              "--schedule", "constant"]
    return root, common


def weights(out):
    return load_file(os.path.join(out, "model.safetensors"))


def cand_flags():
    return [f"{n}|{' '.join(f)}" for n, f in CANDS.items()]


def test_lockstep_equals_each_trained_alone(setup, tmp_path):
    root, common = setup
    reports = main(["--root", str(tmp_path / "many"), *[x for c in cand_flags()
                                                        for x in ("--candidate", c)],
                    "--", *common, "--steps", "6"])
    assert reports["a"]["step"] == 6 and reports["b"]["step"] == 4  # b's own --steps wins
    for name, flags in CANDS.items():
        alone = distill_main([*common, "--steps", "6", *flags, "--out",
                              str(tmp_path / f"alone_{name}")])
        together, by_itself = weights(tmp_path / "many" / f"cand_{name}"), weights(
            tmp_path / f"alone_{name}")
        assert together.keys() == by_itself.keys()
        for k in together:
            assert torch.equal(together[k], by_itself[k]), (name, k)
        assert [h["kl"] for h in reports[name]["history"]] == [
            h["kl"] for h in alone["history"]]


def test_resume_continues_all_of_them(setup, tmp_path):
    """3 steps, then --resume to 6, ends where 6 steps in one go end, for both."""
    root, common = setup
    flags = {n: [x for x in f if x not in ("--steps", "4")] for n, f in CANDS.items()}
    cands = [x for n, f in flags.items() for x in ("--candidate", f"{n}|{' '.join(f)}")]
    straight = main(["--root", str(tmp_path / "s"), *cands, "--", *common, "--steps", "6"])
    first = main(["--root", str(tmp_path / "r"), *cands, "--", *common, "--steps", "3"])
    assert {n: r["step"] for n, r in first.items()} == {"a": 3, "b": 3}
    resumed = main(["--root", str(tmp_path / "r"), "--resume", *cands, "--", *common,
                    "--steps", "6"])
    assert {n: r["step"] for n, r in resumed.items()} == {"a": 6, "b": 6}
    for name in flags:
        w1, w2 = weights(tmp_path / "s" / f"cand_{name}"), weights(tmp_path / "r" / f"cand_{name}")
        assert all(torch.equal(w1[k], w2[k]) for k in w1), name
        assert straight[name]["history"] == resumed[name]["history"]


def test_refusals(setup, tmp_path, capsys):
    root, common = setup
    a = f"a|{' '.join(DRAFT)}"
    with pytest.raises(SystemExit, match="must share --seq-len"):
        main(["--root", str(tmp_path / "x1"), "--candidate", a, "--candidate",
              f"b|{' '.join(DRAFT)} --seq-len 32", "--", *common, "--steps", "1"])
    with pytest.raises(SystemExit, match="names must differ"):
        main(["--root", str(tmp_path / "x2"), "--candidate", a, "--candidate", a, "--",
              *common, "--steps", "1"])
    with pytest.raises(SystemExit, match="NAME.FLAGS"):
        main(["--root", str(tmp_path / "x3"), "--candidate", "no flags here", "--", *common])
    no_data = [x for x in common]
    i = no_data.index("--data-from")
    del no_data[i:i + 2]
    with pytest.raises(SystemExit, match="--data-from is required"):
        main(["--root", str(tmp_path / "x4"), "--candidate", a, "--", *no_data, "--steps", "1"])
    with pytest.raises(SystemExit, match="--eval is not run here"):
        main(["--root", str(tmp_path / "x5"), "--candidate", a + " --eval", "--", *common,
              "--steps", "1"])


def test_check_lockstep_refuses_unshared_parts():
    from types import SimpleNamespace as NS
    batcher, teacher, dev = object(), object(), torch.device("cpu")
    ok = NS(batcher=batcher, teacher=teacher, device=dev, step=0)
    check_lockstep([ok, NS(**vars(ok))])
    for bad, msg in ((dict(batcher=object()), "one Batcher"), (dict(teacher=object()),
                     "one teacher"), (dict(step=3), "same step")):
        with pytest.raises(ValueError, match=msg):
            check_lockstep([ok, NS(**{**vars(ok), **bad})])
    with pytest.raises(ValueError, match="no drafts"):
        check_lockstep([])
