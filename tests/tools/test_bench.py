"""tools/bench.py on the tiny test checkpoints (CPU): tables, the JSON's structure, HF peers."""

import json
import os

import pytest

from tools.bench import breakdown, encode_prompts, main, print_tables

PROMPTS = [[5, 6, 7, 8, 9], {"prompt_ids": [10, 11, 12]}]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return str(path)


def bench(tiny_dirs, prompts_file, out, *extra):
    return main(["--target", tiny_dirs["smol_heads"], "--draft", tiny_dirs["smol_heads_draft"],
                 "--prompts-file", prompts_file, "--n-prompts", "2", "--max-new-tokens", "8",
                 "--max-len", "128", "--json", str(out),
                 *(() if "--passes" in extra else ("--passes", "1")), *extra])


def test_engine_modes_json(tiny_dirs, prompts_file, tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench(tiny_dirs, prompts_file, out, "--modes", "ar,sd,sd:adaptive_k=0") == 0
    printed = capsys.readouterr().out
    assert "greedy==AR" in printed and "per-round time" in printed and "mean K" in printed
    assert "ssdlib._C: " in printed and "float32, torch " in printed  # the machine's line
    report = json.loads(out.read_text())
    assert set(report) >= {"machine", "models", "command", "args", "rows", "breakdown"}
    machine = report["machine"]
    for key in ("gpus", "cpu", "python", "torch", "triton", "transformers", "cuda",
                "ssdlib_commit", "ssdlib_dirty"):
        assert key in machine
    from tools.bench import source_digest
    assert machine["ssdlib_source"] == source_digest() and len(source_digest()) == 12
    from ssdlib.ops._extension import diagnose
    assert machine["ssdlib_extension"].startswith("ssdlib._C: ")  # whether the extension served
    assert machine["ssdlib_extension"] == diagnose()[1].split(" | ")[0]  # diagnose's first part
    assert report["models"]["target"]["path"] == tiny_dirs["smol_heads"]
    assert report["models"]["draft"]["path"] == tiny_dirs["smol_heads_draft"]
    assert "--prompts-file" in report["command"]
    assert report["args"]["modes"] == "ar,sd,sd:adaptive_k=0" and report["args"]["adaptive_k"]
    assert report["prompts"]["prompt_tokens"] == [5, 3]

    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["ar", "sd", "sd:adaptive_k=0"]
    fixed = rows.pop("sd:adaptive_k=0")  # adaptive K off in that row: every round at K = 5
    assert fixed["mean_k"] == 5 and fixed["k0_rounds"] == 0 and fixed["greedy_equals_ar"]
    assert 0 <= rows["sd"]["mean_k"] <= 5 and "round_ms_by_k" in rows["sd"]["k_costs"]
    for r in rows.values():
        assert r["tokens"] == 16 and r["tok_s"] > 0 and r["wall_s"] > 0
        assert 0 < r["decode_tok_s"] and "token_ids" not in r
    assert rows["sd"]["greedy_equals_ar"] is True  # fp32 on CPU: SD is exact
    assert 0 <= rows["sd"]["acceptance_rate"] <= 1

    parts = {b["mode"]: b for b in report["breakdown"]}
    assert parts["ar"]["tokens_per_round"] == pytest.approx(1.0)
    assert parts["ar"]["rounds"] == 14  # 7 decode rounds per prompt, the first token from prefill
    assert set(parts["ar"]["ms_per_round"]) >= {"verify"}
    assert set(parts["sd"]["ms_per_round"]) >= {"draft", "verify"}
    assert parts["sd"]["tokens_per_round"] > 1
    assert all(v >= 0 for b in parts.values() for v in b["ms_per_round"].values())


def test_breakdown_is_generic_over_phase_keys():
    run = {"tokens": 22, "requests": 2, "rounds": 10, "wall_s": 2.0, "ttft_s": 0.1,
           "prefill_s": 0.1, "decode_tok_s": 10.0, "tok_s": 11.0, "verify_s": 0.5,
           "draft_s": 0.2, "some_new_phase_s": 0.01, "tokens_per_round": 2.0}
    b = breakdown("sd", run)
    assert list(b["ms_per_round"]) == ["draft", "verify", "some_new_phase"]
    assert b["ms_per_round"]["verify"] == pytest.approx(50.0)
    assert b["ms_per_round"]["some_new_phase"] == pytest.approx(1.0)
    assert b["tokens_per_round"] == 2.0 and b["rounds"] == 10
    assert b["wall_ms_per_round"] == pytest.approx(200.0)  # batch 1: wall / rounds
    assert "wall_ms_per_round" not in breakdown("sd", run, batch=4)


def test_breakdown_and_table_carry_the_speculators_phases(capsys):
    spec = {"commit": 0.1, "fallback": 0.5, "send": 0.2, "build": 2.0, "push": 0.2}
    run = {"tokens": 22, "requests": 2, "rounds": 10, "verify_s": 0.02, "wait_s": 0.03,
           "tokens_per_round": 2.0, "speculator_rounds": 12, "speculator_ms_per_round": spec}
    b = breakdown("ssd", run)
    assert b["speculator_rounds"] == 12 and b["speculator_ms_per_round"] == spec
    assert list(b["ms_per_round"]) == ["verify", "wait"]  # not mixed into the verifier's
    ar = breakdown("ar", {"tokens": 11, "requests": 1, "rounds": 10, "verify_s": 0.01})
    assert "speculator_ms_per_round" not in ar
    print_tables([], [ar, b])
    out = capsys.readouterr().out
    lines = out[out.index("per-round time"):].splitlines()
    head = next(line for line in lines if line.startswith("mode"))
    cols = [c for c in head.split() if c != "ms"]
    assert cols[-6:] == ["spec.commit", "spec.fallback", "spec.send", "spec.build",
                         "spec.push", "spec.total"]
    ssd = next(line for line in lines if line.startswith("ssd")).split()
    assert [float(v) for v in ssd[-6:]] == pytest.approx([0.1, 0.5, 0.2, 2.0, 0.2, 3.0])
    assert next(line for line in lines if line.startswith("ar")).split()[-6:] == ["-"] * 6


def test_table_prints_ssd_acceptance_by_source(capsys):
    row = {"mode": "ssd", "batch": 1, "tok_s": 10.0,
           "accepted_by_source": {"cache": {"rounds": 6, "mean_accepted": 2.5},
                                  "ngram": {"rounds": 2, "mean_accepted": 0.5}}}
    print_tables([dict(row, mode="ar", accepted_by_source=None), row], [])
    lines = [x for x in capsys.readouterr().out.splitlines() if "accepted by source" in x]
    assert lines == ["ssd accepted by source (mean tokens, rounds): cache 2.50 (6), "
                     "ngram 0.50 (2)"]


def test_token_id_prompts_need_no_tokenizer(tiny_dirs):
    assert encode_prompts(tiny_dirs["smol_heads"], PROMPTS, chat=True) == [[5, 6, 7, 8, 9],
                                                                           [10, 11, 12]]
    with pytest.raises(SystemExit, match="no tokenizer"):
        encode_prompts(tiny_dirs["smol_heads"], ["text"], chat=True)


def test_hf_peers(tiny_dirs, prompts_file, tmp_path):
    transformers = pytest.importorskip("transformers")
    try:
        transformers.AutoModelForCausalLM.from_pretrained(tiny_dirs["smol_heads"])
    except Exception as e:  # noqa: BLE001 - any failure to load means: no peers here
        pytest.skip(f"transformers cannot load the tiny checkpoint: {e}")
    out = tmp_path / "bench.json"
    assert bench(tiny_dirs, prompts_file, out, "--modes", "ar", "--peers", "hf") == 0
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["ar", "hf-ar", "hf-assisted"]
    assert rows["hf-assisted"]["batch"] == 1
    for name in ("hf-ar", "hf-assisted"):
        assert rows[name]["tokens"] == 16 and rows[name]["tok_s"] > 0
        # the same weights and greedy decoding in fp32: HF agrees with our AR
        assert rows[name]["greedy_equals_ar"] is True
    assert [b["mode"] for b in report["breakdown"]] == ["ar"]  # HF rows have no breakdown
    assert report["models"]["draft"]["path"] == tiny_dirs["smol_heads_draft"]


def test_json_token_ids_kept_on_request(tiny_dirs, prompts_file, tmp_path):
    out = tmp_path / "bench.json"
    assert bench(tiny_dirs, prompts_file, out, "--modes", "ar", "--json-token-ids") == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert [len(t) for t in row["token_ids"]] == [8, 8]


def test_mode_variants_run_in_one_invocation(tiny_dirs, prompts_file, tmp_path):
    """``sd:k=2`` is mode sd with K = 2 for its row only: labelled by its spec, exact."""
    out = tmp_path / "bench.json"
    assert bench(tiny_dirs, prompts_file, out, "--modes", "ar,sd,sd:k=2", "--k", "4",
                 "--no-adaptive-k") == 0
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["rows"]}
    assert list(rows) == ["ar", "sd", "sd:k=2"]
    assert rows["sd"]["greedy_equals_ar"] is True and rows["sd:k=2"]["greedy_equals_ar"] is True
    assert rows["sd:k=2"]["options"] == {"k": 2} and "options" not in rows["sd"]
    tpr = {b["mode"]: b["tokens_per_round"] for b in report["breakdown"]}
    assert 1 <= tpr["sd:k=2"] <= 3 and 1 <= tpr["sd"] <= 5  # at most K + 1 tokens a round
    assert tpr["sd:k=2"] != tpr["sd"]
    assert "draft" in report["models"]


def test_mode_option_values():
    from tools.bench import parse_mode

    assert parse_mode("ssd:compile=1:k=2") == ("ssd", {"compile": True, "k": 2})
    assert parse_mode("ar:compile=false") == ("ar", {"compile": False})
    assert parse_mode("sd:adaptive_k=0") == ("sd", {"adaptive_k": False})


def test_mode_variant_sets_an_engine_environment_variable(tiny_dirs, prompts_file, tmp_path,
                                                          monkeypatch):
    """``ssd:env=SSDLIB_Q_AFTER_BUILD=1`` runs that row's ranks with the variable set (a bad
    value fails that row's engine), and the bench's own environment is left as it was."""
    monkeypatch.delenv("SSDLIB_Q_AFTER_BUILD", raising=False)
    out = tmp_path / "bench.json"
    spec = "ssd:env=SSDLIB_Q_AFTER_BUILD=1"
    assert bench(tiny_dirs, prompts_file, out, "--modes", f"ssd,{spec}", "--temperature", "1.0",
                 "--json-token-ids") == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows[spec]["options"] == {"env": ["SSDLIB_Q_AFTER_BUILD", "1"]}
    assert rows[spec]["token_ids"] == rows["ssd"]["token_ids"]  # seeded: the same draws
    assert "SSDLIB_Q_AFTER_BUILD" not in os.environ
    with pytest.raises(Exception, match="SSDLIB_Q_AFTER_BUILD must be 0 or 1"):
        bench(tiny_dirs, prompts_file, out, "--modes", "ssd:env=SSDLIB_Q_AFTER_BUILD=2")
    assert "SSDLIB_Q_AFTER_BUILD" not in os.environ


def test_mode_variant_runs_another_draft(tiny_dirs, prompts_file, tmp_path):
    """``sd:draft=DIR`` runs its row with that draft: a worse draft accepts less, still exact."""
    out = tmp_path / "bench.json"
    bad = tiny_dirs["smol_heads_bad_draft"]
    assert bench(tiny_dirs, prompts_file, out, "--modes", f"ar,sd,sd:draft={bad}",
                 "--no-adaptive-k") == 0
    rows = {r["mode"]: r for r in json.loads(out.read_text())["rows"]}
    other = rows[f"sd:draft={bad}"]
    assert other["options"] == {"draft": bad} and other["greedy_equals_ar"] is True
    assert other["acceptance_rate"] < rows["sd"]["acceptance_rate"]


@pytest.mark.parametrize("spec,message", [("sdx", "engine modes"), ("sd:q=1", "KEY=VALUE"),
                                          ("sd:k", "KEY=VALUE"), ("ssd:k=two", "takes a int"),
                                          ("ar:draft=x", "ar runs no draft"),
                                          ("sd:compile=maybe", "flag (0 or 1)"),
                                          ("ssd:env=PATH=/x", "SSDLIB_NAME=VALUE")])
def test_bad_mode_spec_is_a_clear_error(spec, message, capsys):
    from tools.bench import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--modes", f"ar,{spec}"])
    assert message in capsys.readouterr().err


def test_passes_report_the_median_pass_and_every_pass(tiny_dirs, prompts_file, tmp_path,
                                                      capsys):
    out = tmp_path / "bench.json"
    assert bench(tiny_dirs, prompts_file, out, "--modes", "ar,sd", "--passes", "3") == 0
    assert "passes (tok/s)" in capsys.readouterr().out
    for row in json.loads(out.read_text())["rows"]:
        runs = row["tok_s_passes"]
        assert len(runs) == 3 and row["tok_s"] == pytest.approx(sorted(runs)[1])
        assert row["tokens"] == 16


@pytest.mark.parametrize("value,message", [("0", "--passes must be >= 1 or auto"),
                                           ("many", "invalid pass count")])
def test_passes_must_be_positive_or_auto(value, message, capsys):
    with pytest.raises(SystemExit):
        main(["--passes", value])
    assert message in capsys.readouterr().err


def test_auto_passes_time_odd_counts_until_the_minimum_is_reached():
    from tools.bench import AUTO_MAX_PASSES, enough_passes

    assert not enough_passes([], "auto", 0.0)  # always one pass
    assert enough_passes([0.1], "auto", 0.0)
    assert not enough_passes([0.5], "auto", 2.0)
    assert not enough_passes([0.5, 0.5], "auto", 0.5)  # an even count: one more for a median
    assert enough_passes([0.5, 0.5, 0.5], "auto", 1.5)
    assert enough_passes([3.0], "auto", 2.0)  # a long pass is enough alone
    assert enough_passes([0.01] * AUTO_MAX_PASSES, "auto", 2.0)
    assert not enough_passes([0.01] * 2, 3, 2.0) and enough_passes([9.0] * 3, 3, 0.0)


def test_auto_passes_in_a_run(tiny_dirs, prompts_file, tmp_path):
    """The default: short passes repeat until they add up to --min-timed-s."""
    out = tmp_path / "bench.json"
    assert bench(tiny_dirs, prompts_file, out, "--modes", "ar", "--passes", "auto",
                 "--min-timed-s", "1e9") == 0
    row = json.loads(out.read_text())["rows"][0]
    assert len(row["tok_s_passes"]) == 9 and row["tok_s"] == pytest.approx(
        sorted(row["tok_s_passes"])[4])


def test_the_source_digest_follows_the_files(tmp_path):
    """``ssdlib_source`` changes with a file's content or name, not with other files."""
    from tools.bench import source_digest

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not code")
    first = source_digest(str(tmp_path))
    (tmp_path / "pkg" / "notes.txt").write_text("other")
    assert source_digest(str(tmp_path)) == first
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    changed = source_digest(str(tmp_path))
    assert changed != first
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")
    assert source_digest(str(tmp_path)) not in (first, changed)


def test_chained_verify_is_compared_with_ar_and_sd_verify(capsys):
    def part(mode, verify_s, **extra):
        return dict(breakdown(mode, {"tokens": 20, "requests": 1, "rounds": 10,
                                     "verify_s": verify_s, "tokens_per_round": 2.0}), **extra)
    overlap = {"verify_ms": 1.5, "build_ms": 1.2, "hidden_ms": 1.2}
    ssd = part("ssd", 0.015, chain_overlap=overlap, chained_rounds=9)
    print_tables([], [part("ar", 0.012), part("sd", 0.013), ssd])
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("ssd") and "chained" in x)
    assert "verify 1.500 (1.25x AR's, 1.15x SD's)" in line
    print_tables([], [ssd])  # no AR or SD in the invocation: no ratios
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("ssd") and "chained" in x)
    assert "verify 1.500  build 1.200" in line


def test_the_fanout_estimates_reach_the_json_row_and_a_table_line(capsys):
    model = {"allocation": [5, 4, 3, 4], "a_p": 0.664, "r": 0.668, "c_fresh": 0.603,
             "c_rejected": None, "lookups": {"fresh": 412, "rejected": 0}}
    run = {"tokens": 22, "requests": 2, "rounds": 10, "verify_s": 0.02, "fanout_model": model}
    b = breakdown("ssd", run)
    assert b["fanout_model"] == model
    print_tables([], [b])
    out = capsys.readouterr().out
    line = out[out.index("fan-out estimates"):].splitlines()[1]
    assert line.split() == ["ssd", "5,4,3,4", "a_p", "0.664", "r", "0.668", "c", "0.603", "/",
                            "-", "(412", "/", "0)"]
