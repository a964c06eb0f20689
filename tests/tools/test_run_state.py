"""tools/distill/run_state.py: a run state written atomically and read back whole, clear errors
naming the file, and the shared part (optimizer, batcher, step, history, RNG) restored so that
the run goes on exactly where it was captured."""

import os
import pickle

import pytest
import torch

from tools.distill.data import Batcher
from tools.distill.run_state import (SHARED_KEYS, RunStateError, capture_rng, capture_shared,
                                     read_state, require_keys, restore_rng, restore_shared,
                                     write_state)
from tools.distill.train import Trainer, TrainSettings


def _setup(seed: int = 0):
    """A small model, its optimizer after one step, and a batcher a batch in."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    batcher = Batcher(torch.arange(40).view(10, 4), 3, seed=1)
    batcher.next()
    return model, opt, batcher


def test_write_then_read_round_trips(tmp_path):
    path = str(tmp_path / "sub" / "state.pt")  # the directory is made
    state = {"step": 7, "history": [{"step": 0, "kl": [1.5, 2.0]}], "w": torch.arange(5.0),
             "nested": {"a": [torch.ones(2), 3]}}
    write_state(state, path)
    back = read_state(path, keys=("step", "w"))
    assert back["step"] == 7 and back["history"] == state["history"]
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["nested"]["a"][0], torch.ones(2))
    assert back["nested"]["a"][1] == 3


def test_write_is_atomic_and_leaves_no_tmp(tmp_path):
    path = str(tmp_path / "state.pt")
    write_state({"step": 1}, path)
    write_state({"step": 2}, path)  # replaces the first
    assert sorted(os.listdir(tmp_path)) == ["state.pt"]
    assert read_state(path, keys=("step",))["step"] == 2


def test_a_failed_write_keeps_the_old_state_and_leaves_no_tmp(tmp_path):
    path = str(tmp_path / "state.pt")
    write_state({"step": 1}, path)
    with pytest.raises((AttributeError, TypeError, pickle.PicklingError)):
        write_state({"step": 2, "bad": lambda: None}, path)  # a lambda does not pickle
    assert sorted(os.listdir(tmp_path)) == ["state.pt"]
    assert read_state(path, keys=("step",))["step"] == 1


def test_read_names_a_missing_file(tmp_path):
    path = str(tmp_path / "nothing.pt")
    with pytest.raises(RunStateError, match="nothing.pt: no run state there"):
        read_state(path)


def test_read_names_an_unreadable_file(tmp_path):
    path = tmp_path / "broken.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(RunStateError, match="broken.pt: not a readable run state"):
        read_state(str(path))
    torch.save([1, 2], str(path))
    with pytest.raises(RunStateError, match="broken.pt: not a run state .*list"):
        read_state(str(path))


def test_read_names_missing_keys(tmp_path):
    path = str(tmp_path / "state.pt")
    write_state({"step": 1}, path)
    with pytest.raises(RunStateError, match="state.pt: .*lacks optimizer, batcher"):
        read_state(path)
    with pytest.raises(RunStateError, match="lacks params"):
        require_keys({"step": 1}, ("step", "params"), "the state")


def test_rng_restored_draws_alike():
    torch.manual_seed(3)
    torch.randn(5)
    rng = capture_rng()
    first = torch.randn(8)
    torch.randn(100)  # the generator moves on
    restore_rng(rng)
    assert torch.equal(torch.randn(8), first)
    assert isinstance(rng["rng_cuda"], list)
    assert len(rng["rng_cuda"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)


def test_shared_state_round_trips_through_a_file(tmp_path):
    """Captured, written, read and restored into a fresh optimizer and batcher: the optimizer's
    state, the next batch, the step, the history and the next random draw are the captured
    run's."""
    model, opt, batcher = _setup()
    history = [{"step": 0, "kl": 1.0}]
    shared = capture_shared(5, opt, batcher, history)
    assert set(shared) == set(SHARED_KEYS)
    history.append({"step": 5})  # the state holds a copy
    path = str(tmp_path / "state.pt")
    write_state({**shared, "model": model.state_dict()}, path)
    draw, batch = torch.randn(4), batcher.next()

    model2, opt2, batcher2 = _setup(seed=1)
    torch.randn(50)
    state = read_state(path)
    model2.load_state_dict(state["model"])
    step, history2 = restore_shared(state, opt2, batcher2)
    assert step == 5 and history2 == [{"step": 0, "kl": 1.0}]
    assert torch.equal(torch.randn(4), draw)
    assert torch.equal(batcher2.next(), batch)
    a, b = opt.state_dict()["state"], opt2.state_dict()["state"]
    assert a.keys() == b.keys()
    for k in a:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(a[k][name], b[k][name]), (k, name)


def test_restore_shared_refuses_a_partial_state_before_changing_anything():
    _, opt, batcher = _setup()
    place = batcher.state()
    state = capture_shared(2, opt, batcher, [])
    del state["rng_cpu"]
    batcher.next()
    with pytest.raises(RunStateError, match="lacks rng_cpu"):
        restore_shared(state, opt, batcher)
    assert batcher.state() != place  # not restored


def _trainer(state_dir: str, seed: int) -> Trainer:
    """A Trainer of a tiny model whose bias is frozen (not optimised, not saved)."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    model.bias.requires_grad_(False)
    batcher = Batcher(torch.arange(40).view(10, 4), 3, seed=1)
    return Trainer(model, None, batcher, None, TrainSettings(steps=10, lr=1e-2, warmup=1),
                   state_dir)


def test_trainer_saves_its_own_and_the_shared_part(tmp_path):
    a = _trainer(str(tmp_path / "work"), seed=0)
    a.step, a.tokens_seen, a.history = 4, 96, [{"step": 0}]
    a.batcher.next()
    a.save()
    assert sorted(os.listdir(tmp_path / "work")) == ["last.pt"]
    state = read_state(a.state_path)
    assert set(state) == {*SHARED_KEYS, "tokens_seen", "model"}
    assert list(state["model"]) == ["weight"]  # the frozen bias is not saved
    b = _trainer(str(tmp_path / "work"), seed=1)
    b.load()
    assert (b.step, b.tokens_seen, b.history) == (4, 96, [{"step": 0}])
    assert b.batcher.state() == a.batcher.state()
    assert torch.equal(b.draft.weight, a.draft.weight)


def test_trainer_load_names_a_missing_state(tmp_path):
    with pytest.raises(RunStateError, match="last.pt: no run state there"):
        _trainer(str(tmp_path / "empty"), seed=0).load()
