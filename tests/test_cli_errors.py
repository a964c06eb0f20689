"""Bad input: one clear line on stderr, non-zero exit, no traceback, no hang."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tests.rank_helpers import child_pids

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(*args, env=None, timeout=120):
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-m", "ssdlib.generate", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=full_env)


def assert_clean_error(res, *needles):
    assert res.returncode != 0
    assert "Traceback" not in res.stderr, res.stderr
    lines = [l for l in res.stderr.strip().splitlines() if l.startswith("ssdlib")]
    assert len(lines) == 1, res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_missing_checkpoint():
    assert_clean_error(run_cli("--target", "/nonexistent/model"), "not found", "/nonexistent/model")


def test_corrupt_safetensors(tiny_dirs, tmp_path):
    import shutil

    d = tmp_path / "corrupt"
    shutil.copytree(tiny_dirs["gqa"], d)
    st = d / "model.safetensors"
    st.write_bytes(st.read_bytes()[:1000])
    assert_clean_error(run_cli("--target", str(d), "--prompt", "x"), "safetensors")


def test_unsupported_architecture(tiny_dirs, tmp_path):
    import shutil

    d = tmp_path / "mistralish"
    shutil.copytree(tiny_dirs["gqa"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"], cfg["model_type"] = ["GPT2LMHeadModel"], "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(run_cli("--target", str(d)), "unsupported architecture")


def test_world_size_does_not_fit(tiny_dirs):
    env = {"RANK": "0", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": "29555"}
    res = run_cli("--target", tiny_dirs["gqa"], "--tp", "2", "--mode", "ar", env=env)
    assert_clean_error(res, "world size 3", "--tp 2")


@pytest.mark.parametrize("flag,value,needle", [("--temperature", "-1", "temperature"),
                                              ("--top-p", "1.5", "top_p"),
                                              ("--top-p", "0", "top_p"),
                                              ("--max-new-tokens", "0", "max_new_tokens")])
def test_invalid_sampling(tiny_dirs, flag, value, needle):
    assert_clean_error(run_cli("--target", tiny_dirs["gqa"], flag, value), needle)


def test_prompt_longer_than_context(tmp_path):
    res = run_cli("--prompt", "word " * 400, "--max-len", "64")
    assert_clean_error(res, "longer than the context")


def test_malformed_jsonl(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "ok"}\n{"prompt": broken\n')
    assert_clean_error(run_cli("--prompts-file", str(f)), "p.jsonl:2", "malformed JSON")


@pytest.mark.parametrize("name", ["p.jsonl", "p.txt"])
def test_a_prompts_file_line_that_is_not_utf8(tmp_path, name):
    f = tmp_path / name
    f.write_bytes(b'{"prompt": "ok"}\n' if name.endswith(".jsonl") else b"ok\n")
    with open(f, "ab") as out:
        out.write(b"caf\xe9\n")  # Latin-1, not UTF-8
    assert_clean_error(run_cli("--prompts-file", str(f)), f"{name}:2",
                       "not valid UTF-8 (byte 0xe9 at byte 3)")


def test_draft_vocab_mismatch(tiny_dirs):
    res = run_cli("--target", tiny_dirs["smol_heads"], "--draft", tiny_dirs["gqa"], "--mode", "sd",
                  "--prompt", "x")
    assert res.returncode != 0
    # no tokenizer files in these checkpoints: token-id prompts needed; either error is clean
    assert "Traceback" not in res.stderr


def test_draft_vocab_mismatch_api(tiny_dirs):
    from ssdlib import Generator, SamplingParams
    from ssdlib.errors import SSDError

    with pytest.raises(SSDError, match="vocab size"):
        with Generator(target=tiny_dirs["smol_heads"], draft=tiny_dirs["gqa"], mode="sd") as g:
            g.generate([[1, 2, 3]], SamplingParams(max_new_tokens=4))


def test_killing_the_speculator_stops_the_job(tiny_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5, 6, 7, i]}) + "\n" for i in range(8)))
    proc = subprocess.Popen([sys.executable, "-m", "ssdlib.generate", "--target",
                             tiny_dirs["smol_heads"], "--draft", tiny_dirs["smol_heads_draft"],
                             "--mode", "ssd", "--speculator-placement", "rank",
                             "--prompts-file", str(prompts), "--max-len", "4000",
                             "--max-new-tokens", "3000", "--ignore-eos", "--max-batch", "8"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        kids = []
        while time.time() < deadline:
            kids = child_pids(proc.pid, spawned_ranks_only=True)
            if len(kids) >= 2:
                break
            time.sleep(0.5)
        assert len(kids) >= 2, "ranks did not start"
        time.sleep(8)  # let it get into the decode loop
        os.kill(kids[-1], signal.SIGKILL)  # rank 1 = the speculator (spawned last)
        t0 = time.time()
        _, err = proc.communicate(timeout=30)
        assert time.time() - t0 < 30
        assert proc.returncode != 0
        assert "rank" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()


# -- checked before any model loads ------------------------------------------------------------

def run_main(capsys, *argv):
    from ssdlib.generate import main

    rc = main(list(argv))
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("ssdlib")]
    assert "Traceback" not in err and len(lines) == 1, err
    return rc, lines[0]


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
@pytest.mark.parametrize("flags,needle", [
    (["--fan-out", "1,2"], "--fan-out '1,2': needs K+1 = 6 entries"),
    (["--fan-out", "banana"], "--fan-out 'banana'"),
    (["--fan-out", "all-accepted:0"], "all-accepted:N needs an integer N >= 1"),
    (["--fan-out-budget", "0"], "--fan-out-budget must be an integer >= 1"),
    (["--max-batch", "0"], "--max-batch must be an integer >= 1"),
])
def test_invalid_flags_fail_before_loading(tiny_dirs, no_models, capsys, mode, flags, needle):
    rc, line = run_main(capsys, "--target", tiny_dirs["smol_heads"], "--draft",
                        tiny_dirs["smol_heads_draft"], "--mode", mode, "--prompt", "x", *flags)
    assert rc == 2 and needle in line, line


@pytest.mark.parametrize("flag", ["--output", "--metrics-json"])
def test_unwritable_output_fails_before_loading(tiny_dirs, no_models, capsys, tmp_path, flag):
    target = str(tmp_path / "missing_dir" / "out.json")
    rc, line = run_main(capsys, "--target", tiny_dirs["gqa"], "--prompts-file",
                        _ids_file(tmp_path, [[5, 6, 7]]), flag, target)
    assert rc == 2 and f"{flag} {target}: directory" in line and "does not exist" in line, line


def _ids_file(tmp_path, prompts) -> str:
    f = tmp_path / "ids.jsonl"
    f.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    return str(f)


@pytest.mark.parametrize("mode", ["ar", "ssd"])
def test_prompt_checks_run_before_loading(tiny_dirs, no_models, capsys, tmp_path, mode):
    common = ["--target", tiny_dirs["smol_heads"], "--draft", tiny_dirs["smol_heads_draft"],
              "--mode", mode, "--max-len", "16"]
    rc, line = run_main(capsys, *common, "--prompts-file", _ids_file(tmp_path, [list(range(5,
                                                                                          25))]))
    assert rc == 2 and "longer than the context" in line, line
    rc, line = run_main(capsys, *common, "--prompts-file", _ids_file(tmp_path, [[5, 6, 500]]))
    assert rc == 2 and "token id 500 is outside the vocabulary" in line, line


def test_empty_prompt_fails_before_loading(no_models, capsys, tmp_path):
    from tests.tiny_chat import make_tiny_chat_model

    model = make_tiny_chat_model(str(tmp_path / "chat"))
    rc, line = run_main(capsys, "--target", model, "--mode", "ar", "--prompt", "")
    assert rc == 2 and "the prompt is empty" in line, line
    # an invalid UTF-8 byte in argv arrives as a lone surrogate (surrogateescape)
    rc, line = run_main(capsys, "--target", model, "--mode", "ar", "--prompt", "ab\udcff")
    assert rc == 2 and "not valid Unicode text: a lone surrogate (U+DCFF)" in line, line
