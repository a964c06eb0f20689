"""tools/distill_data.py on a tiny chat target (CPU): two shards and their merge make the same
kind of data.safetensors as distill_draft.py, which then trains from it with --data-from."""

import json
import os

import pytest
import torch

from tests.tiny_chat import make_tiny_chat_model
from tools.distill.data import SOURCES, load_splits
from tools.distill_data import main as data_main
from tools.distill_data import share
from tools.distill_draft import main as draft_main

DOC = '''def {name}(items, limit):
    """Return the items that are smaller than the limit, in their order.

    Items equal to the limit are left out as well.
    """
    return [x for x in items if x < limit]
'''


def gen_args(target: str, texts: str) -> list[str]:
    """distill_data.py gen's arguments for a small run on the tiny target (no shard, no out)."""
    return ["--target", target, "--device", "cpu", "--text-root", texts,
            "--selfinstruct-samples", "9", "--docinstruct-samples", "6",
            "--multiturn-samples", "16",
            "--eval-samples", "4", "--pysrc-tokens", "3000", "--user-max-tokens", "40",
            "--answer-max-tokens", "24", "--gen-batch", "8"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("data")
    target = make_tiny_chat_model(str(root / "target"))
    texts = root / "texts"
    texts.mkdir()
    for i in range(12):
        (texts / f"mod{i}.py").write_text(DOC.format(name=f"smaller{i}") * 3)
    common = gen_args(target, str(texts))
    shards = []
    for i in range(2):
        out = str(root / f"s{i}.safetensors")
        shards.append((out, data_main(["gen", *common, "--shard", f"{i}/2", "--out", out])))
    merged = str(root / "data.safetensors")
    report = data_main(["merge", "--out", merged, *[s for s, _ in shards]])
    return root, target, shards, merged, report


def test_share_adds_up():
    assert [share(7, (i, 3)) for i in range(3)] == [3, 2, 2]
    assert sum(share(7168, (i, 2)) for i in range(2)) == 7168


def test_shards_and_merge(setup):
    root, _, shards, merged, report = setup
    (p0, r0), (p1, r1) = shards
    assert r0["train_by_source"].get("pysrc", 0) > 0
    assert "pysrc" not in r1["train_by_source"]  # pysrc is shard 0's
    for r in (r0, r1):
        assert r["train_by_source"].get("selfinstruct", 0) > 0
        assert r["train_by_source"].get("docinstruct", 0) > 0
        assert r["train_by_source"].get("multiturn", 0) > 0  # in the default --data
        assert r["sampler"]["forwards"] > 0 and os.path.exists(r["args"]["out"] + ".json")
    tr0, ev0 = load_splits(p0)
    tr1, ev1 = load_splits(p1)
    tr, ev = load_splits(merged)
    assert tr.ids == tr0.ids + tr1.ids and ev.ids == ev0.ids + ev1.ids
    assert tr.source == tr0.source + tr1.source and tr.score_from == tr0.score_from + tr1.score_from
    assert ev.source == ev0.source + ev1.source
    assert report["train_tokens"] == r0["train_tokens"] + r1["train_tokens"]
    # the shards sample differently: their self-instruct documents differ
    si = SOURCES.index("selfinstruct")
    d0 = {tuple(d) for d, s in zip(tr0.ids, tr0.source) if s == si}
    d1 = {tuple(d) for d, s in zip(tr1.ids, tr1.source) if s == si}
    assert d0 and d1 and d0 != d1
    with open(merged + ".json") as f:
        assert json.load(f)["train_by_source"] == report["train_by_source"]


def test_merged_data_trains_with_data_from(setup, tmp_path):
    _, target, _, merged, _ = setup
    report = draft_main(["--target", target, "--out", str(tmp_path / "draft"), "--device", "cpu",
                         "--data-from", merged, "--seq-len", "32", "--batch", "4",
                         "--hidden", "16", "--layers", "1", "--heads", "2", "--kv-heads", "1",
                         "--ffn", "32", "--steps", "4", "--eval-every", "4",
                         "--save-every", "4", "--eval-batch", "8"])
    assert report["step"] == 4
    assert report["data"]["by_source"] == load_splits(merged)[0].by_source()
    assert os.path.exists(tmp_path / "draft" / "model.safetensors")


def test_greedy_answers_spread_evenly_and_the_flag_checks_its_range():
    import argparse

    import pytest

    from tools.distill.selfinstruct import GenSettings, answer_temperatures, unit_fraction

    assert answer_temperatures(4, GenSettings()) == [0.7] * 4
    assert answer_temperatures(4, GenSettings(greedy_answers=0.5)) == [0.7, 0.0, 0.7, 0.0]
    assert answer_temperatures(3, GenSettings(greedy_answers=1.0)) == [0.0] * 3
    temps = answer_temperatures(100, GenSettings(greedy_answers=0.25, answer_temperature=0.9))
    assert temps.count(0.0) == 25 and set(temps) == {0.0, 0.9}
    p = argparse.ArgumentParser()
    p.add_argument("--greedy-answers", type=unit_fraction, default=0.0)
    assert p.parse_args(["--greedy-answers", "0.3"]).greedy_answers == 0.3
    with pytest.raises(SystemExit):
        p.parse_args(["--greedy-answers", "1.5"])


def test_sampler_graphs_make_the_same_data(setup, tmp_path):
    """--sampler-graphs (captured decode steps; plain calls on a CPU) writes the same documents
    as shard 1 made without it (same seed)."""
    root, target, shards, _, _ = setup
    p1, r1 = shards[1]
    out = str(tmp_path / "g1.safetensors")
    r = data_main(["gen", *gen_args(target, r1["args"]["text_root"][0]), "--shard", "1/2", "--out", out, "--sampler-graphs"])
    assert r["args"]["sampler_graphs"] is True
    (a_train, a_held), (b_train, b_held) = load_splits(p1), load_splits(out)
    assert a_train.n_tokens() == b_train.n_tokens() > 0
    assert a_train.ids == b_train.ids and a_train.source == b_train.source
    assert a_held.ids == b_held.ids


def test_merging_sets_keeps_held_out_documents_unseen(tmp_path):
    """Two data sets whose splits differ (one holds out a document the other trains on): the
    merge drops that training copy, and keeps every other document of both, in order."""
    from tools.distill.data import Docs, merge_splits, save_splits

    def docs(*rows):
        d = Docs()
        for row in rows:
            d.add(row, 1, "pysrc")
        return d
    a, b = str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors")
    save_splits(a, docs([1, 2, 3], [4, 5, 6]), docs([7, 8, 9]))
    save_splits(b, docs([7, 8, 9], [10, 11]), docs([4, 5, 6]))
    train, held = merge_splits([a, b])
    assert held.ids == [[7, 8, 9], [4, 5, 6]]
    assert train.ids == [[1, 2, 3], [10, 11]]
    assert len(train.score_from) == len(train.source) == 2


def test_rank_tokens_puts_the_leading_ids_first_then_counts_then_ids():
    from tools.distill.vocab import coverage, rank_tokens

    counts = torch.tensor([0, 5, 3, 5, 0, 9, 1])
    ranked, ranked_counts = rank_tokens(counts, leading=[4, 1, 4])
    assert ranked.tolist() == [4, 1, 5, 3, 2, 6]  # 0 never seen: not ranked
    assert ranked_counts.tolist() == [0, 5, 9, 5, 3, 1]
    assert coverage(counts, ranked, [2, 3, 100]) == {2: 5 / 23, 3: 14 / 23, 100: 1.0}


def test_vocab_ranks_the_scored_tokens_of_the_training_documents(setup, tmp_path):
    from ssdlib.loading import load_checkpoint
    from ssdlib.loading.draft_vocab import draft_token_ids, ranking_path, read_ranking

    _, target, _, merged, _ = setup
    ck = load_checkpoint(target)
    report = data_main(["vocab", "--target", target, "--into", str(tmp_path), merged])
    ranked = read_ranking(ranking_path(str(tmp_path)), ck.config.vocab_size)
    train, _ = load_splits(merged)
    expected = torch.zeros(ck.config.vocab_size, dtype=torch.int64)
    for ids, start in zip(train.ids, train.score_from):
        for t in ids[start:]:
            expected[t] += 1
    leading = report["leading"]
    assert set(ck.config.eos_token_ids) <= set(leading)
    assert ranked[:len(leading)].tolist() == leading
    rest = ranked[len(leading):]
    assert set(rest.tolist()) == set(expected.nonzero().flatten().tolist()) - set(leading)
    assert bool((expected[rest][:-1] >= expected[rest][1:]).all())  # most frequent first
    assert report["ranked"] == ranked.numel()
    assert draft_token_ids(str(tmp_path), 3, ck.config.vocab_size).numel() == 3
