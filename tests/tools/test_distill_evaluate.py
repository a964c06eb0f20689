"""tools/distill/evaluate.py (the distill tool's --eval): SD acceptance on the held-out sets, the
model-card block, and the benchmark/training separation of the held-out chat set."""

import gzip
import json

from tests.tiny_chat import make_tiny_chat_model
from tools.distill import evaluate


def test_held_out_chat_set_is_fixed_and_chat_shaped():
    prompts = evaluate.chat_prompts()
    assert len(prompts) == 24
    assert all(p["messages"][0]["role"] == "user" and p["messages"][0]["content"]
               for p in prompts)
    assert len({p["messages"][0]["content"] for p in prompts}) == 24


def test_acceptance_is_one_for_the_target_itself_and_lower_for_another_model(tmp_path):
    target = make_tiny_chat_model(str(tmp_path / "target"), seed=0)
    other = make_tiny_chat_model(str(tmp_path / "other"), seed=1)
    he = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(he, "wt") as f:
        for i in range(2):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n    '''add one'''\n"}) + "\n")
    card = tmp_path / "MODEL_CARD.md"
    card.write_text("# draft\n\nintro\n")
    rows = evaluate.run(target, target, str(he), n=2, k=3, max_new_tokens=8, card=str(card))
    assert [(r["set"], r["temperature"]) for r in rows] == [
        ("chat", 0.0), ("chat", 0.7), ("humaneval", 0.0), ("humaneval", 0.7)]
    # q == p: every draft token is accepted, greedy and sampled
    assert all(r["a_p"] == 1.0 and r["mean_accepted"] == 3.0 for r in rows), rows
    rows2 = evaluate.run(target, other, str(he), n=2, k=3, max_new_tokens=8, card=str(card))
    # another random model (same argmax on these tiny prompts, other probabilities): sampled
    # drafts are rejected at times
    assert all(0.0 <= r["a_p"] < 1.0 for r in rows2 if r["temperature"] > 0), rows2
    text = card.read_text()
    # the block is replaced, not appended again; the card's own text stays
    assert text.startswith("# draft\n\nintro\n") and text.count(evaluate.CARD_BEGIN) == 1
    assert f"{rows2[1]['a_p']:.3f}" in text


def test_acceptance_by_prompt_length(tmp_path):
    """--lengths adds one set per length: prompts of about that many tokens built from HumanEval
    code, the draft's acceptance measured on each (the target as its own draft: 1.0)."""
    from ssdlib.loading import load_checkpoint

    target = make_tiny_chat_model(str(tmp_path / "target"), seed=0)
    he = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(he, "wt") as f:
        for i in range(20):
            f.write(json.dumps({"prompt": f"def f{i}(x):\n", "canonical_solution":
                                f"    return x + {i}\n"}) + "\n")
    rows = evaluate.run(target, target, str(he), n=2, k=3, max_new_tokens=4,
                        with_humaneval=False, lengths=(120, 200))
    assert [r["set"] for r in rows] == ["chat", "chat", "code, 120 tokens", "code, 120 tokens",
                                        "code, 200 tokens", "code, 200 tokens"]
    assert all(r["a_p"] == 1.0 and r["prompts"] == 2 for r in rows), rows
    tok = load_checkpoint(target).tokenizer
    code = evaluate.humaneval_code(str(he))
    for length in (120, 200):
        prompts = evaluate.length_prompts(tok, code, length, 2)
        sizes = [len(tok.encode(p["messages"][0]["content"])) for p in prompts]
        assert all(length // 2 < s <= length for s in sizes), sizes
        assert prompts[0] != prompts[1]


def test_ssd_rows_report_the_caches_speculations(tmp_path):
    """--modes sd,ssd: an SSD run per set and temperature, with its hit rate and the tokens
    accepted per cached speculation (the target as its own draft: every token accepted)."""
    target = make_tiny_chat_model(str(tmp_path / "target"), seed=0)
    rows = evaluate.run(target, target, None, n=2, k=3, max_new_tokens=12,
                        with_humaneval=False, modes=("sd", "ssd"))
    assert [(r["mode"], r["temperature"]) for r in rows] == [
        ("sd", 0.0), ("sd", 0.7), ("ssd", 0.0), ("ssd", 0.7)]
    assert all(r["a_p"] == 1.0 for r in rows), rows
    assert all(r["hit_rate"] is None and r["cache_accepted"] is None for r in rows[:2])
    assert all(r["hit_rate"] > 0 and r["cache_accepted"] == 3.0 for r in rows[2:]), rows
    text = evaluate.table(rows, 3)
    assert text.splitlines()[0].startswith("| mode | set |") and "| ssd | chat | 0.7 |" in text


def test_a_draft_vocabulary_is_measured_as_the_engine_runs_it(tmp_path):
    """--draft-vocab N: the target as its own draft, proposing only its ranking's first 4 tokens
    (and EOS), is no longer accepted everywhere; the table's heading names the vocabulary."""
    import shutil

    import torch

    from ssdlib.loading.draft_vocab import write_ranking

    target = make_tiny_chat_model(str(tmp_path / "target"), seed=0)
    draft = str(tmp_path / "draft")
    shutil.copytree(target, draft)
    write_ranking(draft, torch.tensor([5, 6, 7, 8]), torch.tensor([4, 3, 2, 1]))
    rows = evaluate.run(target, draft, None, n=2, k=3, max_new_tokens=8, with_humaneval=False,
                        draft_vocab=4)
    assert all(r["a_p"] < 1.0 for r in rows), rows
    parsed = evaluate.build_parser().parse_args(["--draft", draft, "--draft-vocab", "4"])
    assert parsed.draft_vocab == 4
