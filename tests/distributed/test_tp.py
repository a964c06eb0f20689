"""TP = 2 and 4 give the TP = 1 logits and greedy tokens (ranks spawned here, CPU, gloo)."""

import queue
import time

import pytest
import torch

from ssdlib.distributed.launcher import RankGroup
from ssdlib.errors import RankFailure
from tests.dist_helpers import failing_rank, tp_channel_rank, tp_logits_rank


def tp_logits(path, tp, ids):
    import torch.multiprocessing as mp

    q = mp.get_context("spawn").Queue()
    ranks = RankGroup(tp, tp_logits_rank, (path, tp, ids, q))
    logits = ranks.wait(q, timeout_s=120)
    ranks.join()
    return logits


@pytest.mark.parametrize("name,tp", [("smol_heads", 4), ("gqa", 2)])
def test_tp_logits_equal_tp1(tiny_dirs, name, tp):
    from tests.models.test_llama import build, fwd

    ck, m, cache = build(tiny_dirs[name])
    ids = torch.randint(0, ck.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    ref = fwd(m, cache, ids, [0, 0], [0, 1])
    out = tp_logits(tiny_dirs[name], tp, ids)
    assert (out - ref).abs().max().item() <= 1e-4


def test_followers_get_the_leaders_host_inputs():
    """A follower's runner is called exactly as the leader's (same values, on the host, same
    kv_len): the two then take the same path (captured step, prefill bucket, eager), so with
    CUDA graphs they capture the same collectives in the same order."""
    import torch.multiprocessing as mp

    steps = [(torch.tensor([[5, 6, 7]]), torch.tensor([[0, 1, 2]]), torch.tensor([0]),
              torch.tensor([[2]])),
             (torch.tensor([[8], [9]]), torch.tensor([[3], [40]]), torch.tensor([0, 1]), None)]
    q = mp.get_context("spawn").Queue()
    ranks = RankGroup(2, tp_channel_rank, (steps, q))
    calls = dict(ranks.wait(q, timeout_s=120) for _ in range(2))
    ranks.join()
    assert len(calls[0]) == 2
    assert calls[1] == calls[0]
    assert all(dev == "cpu" for args, _ in calls[1] for a in args if a for dev in a[:1])
    assert [kv for _, kv in calls[1]] == [3, 41]


def test_tp_generate_equals_tp1(tiny_dirs):
    from ssdlib import Generator, SamplingParams

    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    with Generator(target=tiny_dirs["smol_heads"], max_len=64) as g:
        ref = [o.token_ids for o in g.generate(prompts, params)]
    with Generator(target=tiny_dirs["smol_heads"], tp=2, max_len=64) as g:
        out = [o.token_ids for o in g.generate(prompts, params)]
    assert out == ref


def test_tp2_on_the_captured_step_path_equals_tp1(tiny_dirs, monkeypatch):
    """TP 2 through the GPU's captured-step code path on CPU (``SSDLIB_STEP_GRAPHS=eager``:
    followers take the leader's path step by step, collectives inside the steps), AR and SD,
    greedy == TP 1 AR. Its followers used to abort now and then at interpreter exit (known
    gaps, docs/ARCHITECTURE.md): a clean rank now leaves without the teardown."""
    from ssdlib import Generator, SamplingParams

    prompts = [[3, 4, 5, 6], [7, 8, 9, 10, 11, 12, 13]]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    with Generator(target=tiny_dirs["smol_heads"], max_len=64) as g:
        ref = [o.token_ids for o in g.generate(prompts, params)]
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager")
    for extra in ({"mode": "ar"}, {"mode": "sd", "draft": tiny_dirs["smol_heads_draft"], "k": 3}):
        with Generator(target=tiny_dirs["smol_heads"], tp=2, max_len=64, **extra) as g:
            out = [o.token_ids for o in g.generate(prompts, params)]
        assert out == ref, extra


def test_failing_rank_stops_every_rank_quickly():
    t0 = time.time()
    ranks = RankGroup(3, failing_rank, (1,))
    with pytest.raises(RankFailure, match="boom on purpose"):
        ranks.wait(queue.Queue(), timeout_s=60)  # nothing arrives: the failure must surface
    assert time.time() - t0 < 30
    assert all(not p.is_alive() for p in ranks.procs)


def test_ranks_exit_when_their_parent_is_killed(tiny_dirs, tmp_path):
    """SIGKILL of the process that spawned the ranks must not leave ranks waiting forever."""
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        f"sys.path.insert(0, {os.path.dirname(os.path.dirname(os.path.dirname(__file__)))!r})\n"
        "from ssdlib import Generator\n"
        "if __name__ == '__main__':\n"
        f"    g = Generator(target={tiny_dirs['gqa']!r}, tp=2, max_len=64)\n"
        "    print(' '.join(str(p.pid) for p in g._ranks.procs), flush=True)\n"
        "    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(x) for x in proc.stdout.readline().split()]
    assert len(pids) == 2
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    alive = pids
    while alive and time.time() < deadline:
        time.sleep(0.5)
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split()[2] != "Z"]
    assert not alive, f"ranks {alive} outlived their parent"
