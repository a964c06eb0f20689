"""tools/distill_draft.py --init-from DIR on tiny random targets (CPU): a new run starts from an
exported draft (a plain one and one that uses the target's embedding): --steps 0 exports the same
weights, more steps lower the held-out KL from where the source left it, the frozen shared
embedding is set up as with --embedding-from-target, --resume of such a run does not need DIR,
and conflicting flags are refused with a message that names them."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import tools.distill.models as models
from ssdlib.loading import load_checkpoint
from tools.distill_draft import main

EMBED = "model.embed_tokens.weight"
COMMON = ["--device", "cpu", "--seq-len", "32", "--batch", "8", "--eval-samples", "8",
          "--eval-batch", "8"]
DATA = ["--data", "random-target-samples", "--random-samples", "48", "--random-len", "32"]
# the source drafts: plain (own embedding, width 32) and shared (the target's embedding, width 72)
SOURCES = {
    "plain": ("gqa", ["--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                      "--ffn", "64", "--lr", "1e-2"]),
    "shared": ("smol_heads", ["--embedding-from-target", "--init-layers-from-target", "1",
                              "--lr", "3e-3"]),
}


def run(target, out, *extra):
    return main(["--target", target, "--out", str(out), *COMMON, *extra])


@pytest.fixture(scope="module", params=sorted(SOURCES))
def source(request, tiny_dirs, tmp_path_factory):
    """A draft trained 10 steps and exported: (kind, target, out dir, report, data path)."""
    kind = request.param
    name, flags = SOURCES[kind]
    target = tiny_dirs[name]
    out = tmp_path_factory.mktemp(f"init_from_{kind}") / "src"
    report = run(target, out, *DATA, *flags, "--steps", "10", "--eval-every", "5",
                 "--save-every", "10")
    return kind, target, out, report, os.path.join(str(out) + ".work", "data.safetensors")


@pytest.fixture
def capture(monkeypatch):
    """The in-memory draft of each export (the last one wins)."""
    seen = {}
    real = models.export_hf

    def export(draft, ck, out_dir, storage_dtype):
        seen["draft"] = draft
        return real(draft, ck, out_dir, storage_dtype)

    monkeypatch.setattr(models, "export_hf", export)
    return seen


def check_shared_embedding(kind, target, draft, work_dir):
    """--embedding-from-target's setup: the embedding is the target's, frozen, not checkpointed
    (hence not in the optimizer either: it optimises what requires grad)."""
    if kind != "shared":
        assert draft.model.embed_tokens.weight.requires_grad
        return
    emb = draft.model.embed_tokens.weight
    assert not emb.requires_grad
    assert torch.equal(emb, load_checkpoint(target).weights.get(EMBED))
    if os.path.exists(os.path.join(work_dir, "last.pt")):
        state = torch.load(os.path.join(work_dir, "last.pt"), weights_only=True)
        assert EMBED not in state["model"] and "lm_head.weight" not in state["model"]


def test_steps_0_exports_the_source_weights(source, tmp_path, capture):
    kind, target, src, src_report, data = source
    out = tmp_path / "copy"
    report = run(target, out, "--data-from", data, "--init-from", str(src), "--steps", "0")
    a = load_file(os.path.join(src, "model.safetensors"))
    b = load_file(os.path.join(out, "model.safetensors"))
    assert a.keys() == b.keys()
    assert (EMBED in a) == (kind == "plain")
    for name in a:
        assert b[name].dtype == torch.float16
        assert torch.equal(a[name], b[name]), name  # float16 -> float32 -> float16 is exact
    with open(os.path.join(src, "config.json")) as f:
        src_cfg = json.load(f)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f) == src_cfg
    assert report["step"] == 0 and [h["step"] for h in report["history"]] == [0]
    # the step-0 evaluation is the source draft's (float16-rounded) final one
    assert report["history"][0]["kl"] == pytest.approx(src_report["history"][-1]["kl"],
                                                       rel=2e-2, abs=1e-4)
    with open(os.path.join(out, "distill.json")) as f:
        recorded = json.load(f)["init_from"]
    assert recorded == {"path": os.path.abspath(src), "config": src_cfg}
    check_shared_embedding(kind, target, capture["draft"], str(out) + ".work")


def test_continuing_lowers_the_held_out_kl(source, tmp_path, capture):
    kind, target, src, src_report, data = source
    out = tmp_path / "more"
    report = run(target, out, "--data-from", data, "--init-from", str(src), "--steps", "8",
                 "--lr", "2e-3", "--schedule", "constant", "--eval-every", "4",
                 "--save-every", "4")
    history = report["history"]
    assert [h["step"] for h in history] == [0, 4, 8]
    fresh = src_report["history"][0]["kl"]  # a new draft's
    start = history[0]["kl"]
    assert start == pytest.approx(src_report["history"][-1]["kl"], rel=2e-2, abs=1e-4)
    assert start < 0.95 * fresh, (fresh, history)  # it did start from the trained source
    assert history[-1]["kl"] < start, history
    a = load_file(os.path.join(src, "model.safetensors"))
    b = load_file(os.path.join(out, "model.safetensors"))
    assert a.keys() == b.keys() and any(not torch.equal(a[n], b[n]) for n in a)
    check_shared_embedding(kind, target, capture["draft"], str(out) + ".work")


def test_resume_of_an_init_from_run_needs_no_source(source, tmp_path):
    """The architecture and init_from are saved with the run: its source may be gone on
    --resume, which ends with the weights of the same run in one go."""
    kind, target, src, _, data = source
    copy = tmp_path / "src_copy"
    shutil.copytree(src, copy)
    common = ["--data-from", data, "--init-from", str(copy), "--schedule", "constant",
              "--lr", "2e-3", "--eval-every", "2", "--save-every", "2"]
    straight = run(target, tmp_path / "a", *common, "--steps", "4")
    first = run(target, tmp_path / "b", *common, "--steps", "2")
    assert first["step"] == 2
    shutil.rmtree(copy)
    resumed = main(["--target", target, "--out", str(tmp_path / "b"), "--device", "cpu",
                    "--resume", "--init-from", str(copy), "--steps", "4"])
    assert resumed["step"] == 4 and resumed["tokens_seen"] == straight["tokens_seen"]
    assert resumed["init_from"]["path"] == os.path.abspath(copy)
    assert resumed["init_from"]["config"] == straight["init_from"]["config"]
    assert resumed["draft"]["config"] == straight["draft"]["config"]
    a = load_file(os.path.join(tmp_path / "a", "model.safetensors"))
    b = load_file(os.path.join(tmp_path / "b", "model.safetensors"))
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_agreeing_architecture_flags_are_accepted(source, tmp_path):
    kind, target, src, _, data = source
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    flags = ["--hidden", str(cfg["hidden_size"]), "--layers", str(cfg["num_hidden_layers"]),
             "--head-dim", str(cfg["head_dim"])]
    if kind == "shared":
        flags.append("--embedding-from-target")
    report = run(target, tmp_path / "d", "--data-from", data, "--init-from", str(src),
                 "--steps", "0", *flags)
    assert report["draft"]["config"]["hidden_size"] == cfg["hidden_size"]


CONFLICTS = {
    "plain": [
        (["--hidden", "64"], r"disagrees with --hidden 64 \(its hidden_size is 32\): drop"),
        (["--heads", "4", "--ffn", "64"], r"--heads 4 \(its num_attention_heads is 2\)"),
        (["--embedding-from-target"], r"--embedding-from-target \(its config.json has no "
                                      r"ssdlib_embedding_from_target"),
        (["--init-embeddings-from-target"], r"--init-embeddings-from-target would initialise"),
    ],
    "shared": [
        (["--layers", "2"], r"disagrees with --layers 2 \(its num_hidden_layers is 1\)"),
        (["--kv-heads", "1"], r"--kv-heads 1 \(its num_key_value_heads is 3\)"),
        (["--init-layers-from-target", "0"], r"--init-layers-from-target would initialise"),
    ],
}


def test_conflicting_flags_are_refused(source, tmp_path):
    kind, target, src, _, data = source
    for extra, match in CONFLICTS[kind]:
        with pytest.raises(SystemExit, match=match):
            run(target, tmp_path / "d", "--data-from", data, "--init-from", str(src),
                "--steps", "0", *extra)
    assert not os.path.exists(tmp_path / "d" / "config.json")
    with pytest.raises(SystemExit, match="--out is the same directory"):
        run(target, src, "--work-dir", str(tmp_path / "w"), "--data-from", data,
            "--init-from", str(src), "--steps", "0")
    with pytest.raises(SystemExit, match="no config.json there"):
        run(target, tmp_path / "d", "--data-from", data, "--init-from", str(tmp_path),
            "--steps", "0")


def test_resume_with_another_init_from_is_refused(source, tmp_path):
    kind, target, src, _, data = source
    # a run started from scratch (the source run itself) and one started from src
    with pytest.raises(SystemExit, match=r"started from a new draft \(no --init-from\); "
                                         r"--init-from .* would start another one"):
        main(["--target", target, "--out", str(src), "--device", "cpu", "--resume",
              "--init-from", str(src), "--steps", "10"])
    run(target, tmp_path / "b", "--data-from", data, "--init-from", str(src), "--steps", "0")
    other = tmp_path / "other"
    shutil.copytree(src, other)
    with pytest.raises(SystemExit, match=f"which started from {src}; --init-from {other}"):
        main(["--target", target, "--out", str(tmp_path / "b"), "--device", "cpu",
              "--resume", "--init-from", str(other), "--steps", "0"])


def test_init_from_an_extracted_candidate_tar(tmp_path):
    """The fresh-machine path of dev/gpu_draft.sh: a candidate packed like the shipped draft
    asset (no tokenizer files, tokenizer_source.json naming the target's), extracted, continued."""
    import tarfile

    from tests.tiny_chat import make_tiny_chat_model
    from tools.distill import candidates

    target = make_tiny_chat_model(str(tmp_path / "target"))  # has a tokenizer to name
    run(target, tmp_path / "src", *DATA, "--embedding-from-target", "--layers", "1",
        "--steps", "2")
    candidates.pack(str(tmp_path / "src"), str(tmp_path / "s.tar"), same_as=target,
                    target=target)
    ext = tmp_path / "ext"
    with tarfile.open(tmp_path / "s.tar") as tar:
        tar.extractall(ext)
    assert not os.path.exists(ext / "tokenizer.json") and os.path.exists(
        ext / "tokenizer_source.json")
    data = str(tmp_path / "src.work" / "data.safetensors")
    run(target, tmp_path / "cont", "--data-from", data, "--init-from", str(ext), "--steps", "0")
    a = load_file(os.path.join(ext, "model.safetensors"))
    b = load_file(os.path.join(tmp_path / "cont", "model.safetensors"))
    assert a.keys() == b.keys() and EMBED not in a
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_sliding_window_is_set_kept_and_removed(source, tmp_path):
    """--sliding-window W gives the exported draft a window; a run from it keeps the window
    unless --sliding-window says otherwise (0: none); the weights are unchanged by either."""
    kind, target, src, _, data = source

    def config(out):
        with open(os.path.join(out, "config.json")) as f:
            return json.load(f)

    windowed = tmp_path / "windowed"
    run(target, windowed, "--data-from", data, "--init-from", str(src), "--steps", "0",
        "--sliding-window", "128")
    assert config(windowed)["sliding_window"] == 128
    assert config(windowed)["model_type"] == "mistral"
    assert load_checkpoint(str(windowed)).config.sliding_window == 128
    kept = tmp_path / "kept"
    run(target, kept, "--data-from", data, "--init-from", str(windowed), "--steps", "0")
    assert config(kept)["sliding_window"] == 128
    removed = tmp_path / "removed"
    run(target, removed, "--data-from", data, "--init-from", str(kept), "--steps", "0",
        "--sliding-window", "0")
    assert "sliding_window" not in config(removed) and config(removed)["model_type"] == "llama"
    a = load_file(os.path.join(src, "model.safetensors"))
    b = load_file(os.path.join(removed, "model.safetensors"))
    assert all(torch.equal(a[n], b[n]) for n in a)
    with pytest.raises(SystemExit, match="sliding_window"):
        run(target, tmp_path / "bad", "--data-from", data, "--init-from", str(src),
            "--steps", "0", "--sliding-window", "64")
