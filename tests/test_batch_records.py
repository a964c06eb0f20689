"""Batch records: no id invented or repeated, strict fields and types, output files with ordinary
permissions; outputs checked writable (by opening them) before any model loads, an output that is
the input refused; an SSD batch whose records end on their first token completes, every record
once."""

import json
import os
import stat
import subprocess
import sys

import pytest

from ssdlib import Generator, SamplingParams
from ssdlib.batch import read_records, run_batch
from ssdlib.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULTS = SamplingParams(max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def gen(tiny_dirs):
    with Generator(target=tiny_dirs["gqa"], max_len=64, max_batch=4) as g:
        yield g


def write_lines(path, lines):
    path.write_text("".join(l + "\n" for l in lines))


def test_integer_ids_around_a_malformed_line_stay_unique(gen, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    lines = [json.dumps({"id": i, "prompt_ids": [5, 6, i + 1]}) for i in range(6)]
    lines[3] = '{"id": 3, "prompt_ids": [5, 6,'  # malformed: its id cannot be read
    write_lines(inp, lines)
    for _ in range(2):  # a rerun keeps it so
        run_batch(gen, read_records(str(inp), DEFAULTS), str(out), chat=False, chunk=2)
        recs = [json.loads(l) for l in out.read_text().splitlines()]
        assert [r["id"] for r in recs] == [0, 1, 2, None, 4, 5]
        assert recs[3]["line"] == 4 and "malformed JSON" in recs[3]["error"]
    # the line fixed: the rerun generates it; every record once, in input order
    lines[3] = json.dumps({"id": 3, "prompt_ids": [5, 6, 4]})
    write_lines(inp, lines)
    summary = run_batch(gen, read_records(str(inp), DEFAULTS), str(out), chat=False, chunk=2)
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == list(range(6)) and summary["skipped_done"] == 5
    assert all("error" not in r and len(r["token_ids"]) == 3 for r in recs)


def test_a_line_that_is_not_utf8_spoils_only_itself(gen, tmp_path):
    """Invalid UTF-8 bytes in one line (of the input, or of an earlier run's output) are that
    line's error record; every other record is generated and kept."""
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = [json.dumps({"id": i, "prompt_ids": [5, 6, i + 1]}).encode() for i in range(3)]
    inp.write_bytes(good[0] + b"\n" + b'{"id": 9, "prompt": "\xff\xfe"}\n' + good[1] + b"\n"
                    + good[2] + b"\n")
    run_batch(gen, read_records(str(inp), DEFAULTS), str(out), chat=False, chunk=2)
    recs = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in recs] == [0, None, 1, 2]
    assert recs[1]["error"] == "in.jsonl:2: not valid UTF-8 (byte 0xff at byte 21)", recs[1]
    assert all(len(r["token_ids"]) == 3 for r in recs if r["id"] is not None)
    # an output line spoilt in the same way: its record is generated again, the others kept
    lines = out.read_bytes().split(b"\n")
    lines[2] = lines[2].replace(b'"id": 1', b'"id": \xff')
    out.write_bytes(b"\n".join(lines))
    summary = run_batch(gen, read_records(str(inp), DEFAULTS), str(out), chat=False, chunk=2)
    assert summary["skipped_done"] == 2
    assert [json.loads(l)["id"] for l in out.read_text().splitlines()] == [0, None, 1, 2]


@pytest.mark.parametrize("record,needle", [
    ({"id": "a", "prompt": "x", "max_tokens": 5}, "unknown field 'max_tokens' (did you mean "
                                                  "'max_new_tokens'?)"),
    ({"id": "a", "prompt_ids": [5], "max_new_tokens": True}, "'max_new_tokens' must be an "
                                                             "integer, got true"),
    ({"id": "a", "prompt_ids": [5], "temperature": True}, "'temperature' must be a number"),
    ({"id": "a", "prompt_ids": [5], "top_k": 2.5}, "'top_k' must be an integer"),
    ({"id": "a", "prompt_ids": [5], "ignore_eos": 1}, "'ignore_eos' must be true or false"),
    ({"id": "a", "prompt_ids": [5], "stop": [1]}, "'stop' must be a string or a list"),
    ({"id": "a", "prompt_ids": [5, True]}, "'prompt_ids' must be a list of integer token ids"),
    ({"id": "a", "prompt": "x", "prompt_ids": [5]}, "exactly one of"),
    ({"id": "a", "prompt_ids": [5], "max_new_tokens": 0}, "max_new_tokens must be a positive"),
    ({"id": True, "prompt_ids": [5]}, "'id' must be a string or an integer"),
])
def test_bad_fields_are_error_records(tmp_path, record, needle):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [json.dumps({"id": "ok", "prompt_ids": [5]}), json.dumps(record)])
    recs = read_records(str(inp), DEFAULTS)
    assert recs[0].error is None and recs[1].error is not None
    assert needle in recs[1].error and "in.jsonl:2" in recs[1].error, recs[1].error


def test_duplicate_ids_are_refused(tmp_path):
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [json.dumps({"id": 7, "prompt_ids": [5]}), json.dumps({"prompt_ids": [6]}),
                      json.dumps({"id": 7, "prompt_ids": [7]})])
    with pytest.raises(ConfigError, match="in.jsonl:3: id 7 is already used on line 1"):
        read_records(str(inp), DEFAULTS)


def test_output_files_get_ordinary_permissions(gen, tmp_path):
    from ssdlib.jsonl import write_jsonl_atomic

    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [json.dumps({"id": 1, "prompt_ids": [5, 6]})])
    old = os.umask(0o022)
    try:
        run_batch(gen, read_records(str(inp), DEFAULTS), str(out), chat=False, chunk=1)
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o644
        os.chmod(out, 0o640)  # a file that exists keeps its mode
        write_jsonl_atomic(str(out), [{"id": 1}])
        assert stat.S_IMODE(os.stat(out).st_mode) == 0o640
    finally:
        os.umask(old)


@pytest.mark.parametrize("flag", ["--output", "--summary-json"])
def test_unwritable_outputs_fail_before_models_load(tiny_dirs, tmp_path, flag, monkeypatch,
                                                    capsys):
    import ssdlib.generator as generator
    from tools import batch_generate

    def no_models(*a, **k):
        raise AssertionError("models loaded before the output was checked")

    monkeypatch.setattr(generator, "build_rank", no_models)
    inp = tmp_path / "in.jsonl"
    write_lines(inp, [json.dumps({"id": 1, "prompt_ids": [5, 6]})])
    paths = {"--output": str(tmp_path / "out.jsonl"), "--summary-json": None}
    paths[flag] = str(tmp_path / "no" / "such" / "dir" / "x.json")
    argv = ["--target", tiny_dirs["gqa"], "--input", str(inp), "--output", paths["--output"]]
    if paths["--summary-json"]:
        argv += ["--summary-json", paths["--summary-json"]]
    assert batch_generate.main(argv) == 2
    err = capsys.readouterr().err
    assert f"ssdlib error: {flag}" in err and "does not exist" in err, err




@pytest.mark.parametrize("alias", ["same path", "another path", "symlink", "hard link"])
def test_output_that_is_the_input_is_refused_before_models_load(tiny_dirs, tmp_path, alias,
                                                                no_models, capsys):
    from tools import batch_generate

    inp = tmp_path / "in.jsonl"
    write_lines(inp, [json.dumps({"id": 1, "prompt_ids": [5, 6]})])
    before = inp.read_bytes()
    (tmp_path / "sub").mkdir()
    out = {"same path": str(inp), "another path": str(tmp_path / "sub" / ".." / "in.jsonl"),
           "symlink": str(tmp_path / "link.jsonl"), "hard link": str(tmp_path / "hard.jsonl")}
    if alias == "symlink":
        os.symlink(inp, out[alias])
    elif alias == "hard link":
        os.link(inp, out[alias])
    rc = batch_generate.main(["--target", tiny_dirs["gqa"], "--input", str(inp), "--output",
                              out[alias]])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("ssdlib")]
    assert rc == 2 and lines == [f"ssdlib error: --output {out[alias]} is the --input file; "
                                 "choose another path for the output"], err
    assert inp.read_bytes() == before


def test_output_that_cannot_be_opened_fails_before_models_load(tiny_dirs, tmp_path, no_models,
                                                               capsys):
    """/proc takes no new files, even from root (whom the permission bits let through)."""
    from tools import batch_generate

    inp = tmp_path / "in.jsonl"
    write_lines(inp, [json.dumps({"id": 1, "prompt_ids": [5, 6]})])
    out = "/proc/ssdlib-batch-out.jsonl"
    rc = batch_generate.main(["--target", tiny_dirs["gqa"], "--input", str(inp), "--output",
                              out])
    err = capsys.readouterr().err
    lines = [l for l in err.splitlines() if l.startswith("ssdlib")]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith(f"ssdlib error: --output {out}"), \
        err


def test_the_writability_check_leaves_no_file_behind(tmp_path):
    from ssdlib.jsonl import check_writable

    check_writable(str(tmp_path / "new.jsonl"), "--output")
    (tmp_path / "old.jsonl").write_text("kept\n")
    check_writable(str(tmp_path / "old.jsonl"), "--output")
    assert sorted(os.listdir(tmp_path)) == ["old.jsonl"]
    assert (tmp_path / "old.jsonl").read_text() == "kept\n"


def test_ssd_batch_with_records_ending_on_their_first_token(tiny_dirs, tmp_path):
    """SSD batch: records whose first token is EOS and records with max_new_tokens=1 next to
    ordinary ones complete; every record once, in order."""
    from tests.eos_first import find_eos_first_prompt

    eos_first = find_eos_first_prompt(tiny_dirs["smol_heads"])
    if eos_first is None:
        pytest.skip("no EOS-first prompt found for the tiny target")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    recs = []
    for i in range(9):
        kind = i % 3
        rec = {"id": f"r{i}", "prompt_ids": eos_first if kind == 0 else [5 + i, 6, 7]}
        if kind == 1:
            rec["max_new_tokens"] = 1
        recs.append(rec)
    write_lines(inp, [json.dumps(r) for r in recs])
    res = subprocess.run([sys.executable, "tools/batch_generate.py", "--target",
                          tiny_dirs["smol_heads"], "--draft", tiny_dirs["smol_heads_draft"],
                          "--mode", "ssd", "--input", str(inp), "--output", str(out),
                          "--chunk", "4", "--max-batch", "3", "--max-len", "64",
                          "--max-new-tokens", "8"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    got = [json.loads(l) for l in out.read_text().splitlines()]
    assert [r["id"] for r in got] == [f"r{i}" for i in range(9)]
    assert all("error" not in r for r in got), got
    for i, r in enumerate(got):
        if i % 3 == 0:
            assert r["token_ids"] == [] and r["finish_reason"] == "eos"
        elif i % 3 == 1:
            assert len(r["token_ids"]) == 1


def test_the_whole_file_decides_compile_and_warms_up_before_the_first_chunk(tiny_dirs, tmp_path,
                                                                             monkeypatch):
    """The engine starts with every valid record's prompt (compile="auto" sees the file's work:
    a short file does not compile) and warms up on them before the first chunk is timed; the
    summary carries ready_s apart from the decode wall."""
    monkeypatch.setenv("SSDLIB_STEP_GRAPHS", "eager-all")
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_lines(inp, [json.dumps({"id": i, "prompt_ids": [5, 6, i + 1]}) for i in range(5)]
                + ['{"id": 9, "prompt": ""}'])
    with Generator(target=tiny_dirs["gqa"], max_len=64, max_batch=2, start=False) as g:
        summary = run_batch(g, read_records(str(inp), DEFAULTS), str(out), chat=False, chunk=2)
        assert g.cfg.compile is False  # 5 records of 3 tokens: far below the compile rule
        assert g.warm_up_s > 0 and summary["ready_s"] == pytest.approx(g.ready_s)
        assert summary["errors"] == 1 and summary["tokens"] == 15
