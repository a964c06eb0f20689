"""A failing rank: the first failure is reported (its rank, role and message), never replaced by
a later one; its kind keeps its exit code across processes; Ctrl-C stops a job at once."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import pytest

from ssdlib import Generator, SamplingParams
from ssdlib.distributed.launcher import RankGroup
from ssdlib.errors import CheckpointError, RankFailure
from tests.rank_helpers import child_pids, scripted_rank, teardown_abort_rank

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _terminal_sigint() -> None:
    """In the child: SIGINT as a terminal's foreground job has it. A background job of a
    non-interactive shell (e.g. a test run started with ``&``) inherits SIGINT ignored, and a
    Python started with SIGINT ignored never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _failure(plan, roles=None, markers=None) -> RankFailure:
    if markers is not None:
        plan = dict(plan, markers=str(markers))
    ranks = RankGroup(2, scripted_rank, (plan,), roles=roles)
    with pytest.raises(RankFailure) as info:
        ranks.wait(queue.Queue(), timeout_s=60)
    assert all(not p.is_alive() for p in ranks.procs)
    # asking again (e.g. while closing) gives the same failure, not "rank 0 died"
    with pytest.raises(RankFailure) as again:
        ranks.check()
    assert again.value is info.value
    return info.value


def test_a_rank_whose_work_returned_exits_0_past_a_teardown_crash():
    """A rank that returns leaves without the interpreter's teardown (os._exit(0) after its
    queues are flushed): a crash there must not turn a finished job into a failure."""
    import torch.multiprocessing as tmp
    results = tmp.get_context("spawn").Queue()
    ranks = RankGroup(2, teardown_abort_rank, (results,))
    got = sorted(ranks.wait(results, timeout_s=60) for _ in range(2))
    ranks.join(30)  # raises RankFailure if a rank died (an abort: "killed by SIGABRT")
    assert got == [0, 1] and [p.exitcode for p in ranks.procs] == [0, 0]


def test_a_reported_error_keeps_its_kind_and_exit_code(tmp_path):
    from ssdlib.errors import exit_code

    # rank 0 fails 0.5 s after rank 1 acts (not after its own start: spawning may take longer)
    err = _failure({1: (0.0, "checkpoint"), 0: (0.5, "runtime", 1)},
                   roles=["leader", "speculator"], markers=tmp_path)
    assert err.rank == 1 and "rank 1 (speculator) failed" in str(err), err
    assert "missing" in str(err) and "Connection closed" not in str(err)
    assert isinstance(err.cause, CheckpointError)
    assert exit_code(err) == 2 == exit_code(CheckpointError("found in the main process"))


def test_a_rank_killed_without_a_report_is_the_cause(tmp_path):
    from ssdlib.errors import exit_code

    # rank 0 then fails on the broken connection, with a report; the silent death came first
    err = _failure({1: (0.0, "sigkill"), 0: (0.3, "runtime", 1)}, markers=tmp_path)
    assert err.rank == 1 and "killed by SIGKILL" in str(err), err
    assert err.cause is None and exit_code(err) == 1


@pytest.fixture(scope="module")
def long_job(tiny_dirs, tmp_path_factory):
    """An SSD run that decodes for far longer than any of these tests wait."""
    prompts = tmp_path_factory.mktemp("long") / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5, 6, 7, i]}) + "\n" for i in range(4)))
    return ["--target", tiny_dirs["smol_heads"], "--draft", tiny_dirs["smol_heads_draft"],
            "--mode", "ssd", "--speculator-placement", "rank", "--prompts-file", str(prompts),
            "--max-len", "4000",
            "--max-new-tokens", "3000", "--ignore-eos", "--max-batch", "4"]


def test_leaving_the_with_block_keeps_the_first_error(tiny_dirs):
    """The speculator is killed mid-generation: the error names it, and closing the Generator on
    the way out of ``with`` does not replace it with "rank 0 died"."""
    params = SamplingParams(max_new_tokens=3000, ignore_eos=True)
    with pytest.raises(RankFailure) as info:
        with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["smol_heads_draft"],
                       mode="ssd", max_len=4000, max_batch=2,
                       speculator_placement="rank") as g:
            speculator = g._ranks.procs[1].pid
            threading.Timer(1.0, os.kill, (speculator, signal.SIGKILL)).start()
            g.generate([[5, 6, 7], [8, 9, 10]], params)
    msg = str(info.value)
    assert "rank 1 (speculator) died: killed by SIGKILL" in msg, msg
    assert "rank 0" not in msg


def test_ctrl_c_stops_a_spawned_job_at_once(long_job):
    """A terminal's Ctrl-C (SIGINT to the whole process group) during SSD decoding: exit 130
    within seconds, one line, no rank failure reported."""
    proc = subprocess.Popen([sys.executable, "-m", "ssdlib.generate", *long_job,
                             "--no-stream"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=_terminal_sigint)
    try:
        time.sleep(1.0)
        deadline = time.time() + 60  # wait until the ranks are decoding (their CPU time grows)
        while time.time() < deadline and len(child_pids(proc.pid, True)) < 2:
            time.sleep(0.2)
        time.sleep(3.0)
        assert proc.poll() is None, proc.communicate()[1]
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.time()
        _, err = proc.communicate(timeout=30)
        assert time.time() - t0 < 5, err
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "rank failure" not in err, err
        assert [l for l in err.splitlines() if l.startswith("ssdlib")] == \
            ["ssdlib: interrupted"], err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_checkpoint_error_found_by_a_spawned_rank_exits_2(tiny_dirs, tmp_path):
    """The draft's config and header are fine (the main process accepts it), a tensor is
    missing (only the speculator rank, loading weights, finds it): exit 2 like any checkpoint
    error, and the line names the rank."""
    import shutil

    from safetensors.torch import load_file, save_file

    d = tmp_path / "draft_missing_tensor"
    shutil.copytree(tiny_dirs["smol_heads_draft"], d)
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.down_proj.weight"]
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt_ids": [5, 6, 7]}\n')
    res = subprocess.run([sys.executable, "-m", "ssdlib.generate", "--target",
                          tiny_dirs["smol_heads"], "--draft", str(d), "--mode", "ssd",
                          "--speculator-placement", "rank",
                          "--prompts-file", str(prompts), "--max-len", "64"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    lines = [l for l in res.stderr.splitlines() if l.startswith("ssdlib")]
    assert res.returncode == 2, res.stderr
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert "rank 1 (speculator) failed" in lines[0] and "down_proj" in lines[0], lines[0]




def test_a_script_without_a_main_guard_gets_one_clear_error(tiny_dirs, tmp_path):
    """Ranks are spawned and import the main script again: a script that creates a Generator at
    import time would start it in every child. Each child says so in one line (no bootstrap
    traceback) and the parent's error names the fix, not "exited without reporting an error"."""
    script = tmp_path / "unguarded.py"
    script.write_text(
        "import sys\n"
        "from ssdlib import Generator\n"
        "from ssdlib.errors import SSDError\n"
        "try:\n"
        f"    g = Generator(target={tiny_dirs['smol_heads']!r}, mode='ar', tp=2, max_len=64)\n"
        "except SSDError as e:\n"
        "    print('ERROR', e)\n"
        "    sys.exit(3)\n")
    proc = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "died while starting" in proc.stdout and 'if __name__ == "__main__":' in proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("ssdlib: ranks are spawned") for line in lines), lines
