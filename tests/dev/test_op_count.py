"""dev/op_count.py: what it counts, and every hot-path step counted on the tiny checkpoints."""

import json

import torch

from dev.op_count import OpCounter, count, main


def test_counts_computing_ops_not_views_and_host_reads_apart():
    x = torch.arange(6.0)

    def work():
        y = (x + 1).view(2, 3).t()  # one kernel; view and transpose are free
        z = y.sum()  # one kernel
        return z.item()  # a host read, not a kernel
    c = count(work)
    assert isinstance(c, OpCounter)
    assert dict(c.ops) == {"aten::add": 1, "aten::sum": 1}
    assert c.total == 2 and c.host_reads == 1


def test_every_step_counted_on_tiny_models(tiny_dirs, tmp_path, capsys):
    out = tmp_path / "ops.json"
    assert main(["--target", tiny_dirs["smol_heads"], "--draft", tiny_dirs["smol_heads_draft"],
                 "--fan-out-budget", "6", "--json", str(out)]) == 0
    steps = json.loads(out.read_text())["steps"]
    printed = capsys.readouterr().out
    for name, c in steps.items():
        assert c["ops"] > 0 and f"| {name} | {c['ops']} |" in printed
    ops = {name: c["ops"] for name, c in steps.items()}
    # sampling adds work to each step it enters; hit rows add the continuation step
    assert ops["SD draft chain, sampled (3 steps)"] > ops["SD draft chain (3 steps)"]
    assert ops["speculator build, sampled"] > ops["speculator build, greedy"]
    assert ops["speculator build, greedy, hit rows"] > ops["speculator build, greedy"]
    assert ops["acceptance, sampled (T=0.7)"] > ops["acceptance, greedy"]
    # the captured steps read nothing back to the host; the engine-path steps do (the round's
    # read-back, the host's key length)
    assert all(c["host_reads"] == 0 for n, c in steps.items() if "engine path" not in n)
    assert steps["SD verify round, engine path (greedy, read back)"]["host_reads"] > 0
    # the attention op counts once a layer
    assert steps["draft decode step"]["by_op"]["ssdlib::slot_attention"] == 2
