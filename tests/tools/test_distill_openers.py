"""Self-instruct user turns with task openers (tiny chat target, CPU): each request starts with
the opener its turn was given, the target writes the rest, several kinds of task come out, and
the openers are seeded."""

import pytest
import torch

from tests.tiny_chat import make_tiny_chat_model
from tools.distill import models
from tools.distill.selfinstruct import TASK_OPENERS, ChatFormat, GenSettings, user_turns


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    from ssdlib.loading import load_checkpoint

    ck = load_checkpoint(make_tiny_chat_model(str(tmp_path_factory.mktemp("chat") / "t")))
    return models.load_teacher(ck, torch.device("cpu"), torch.float32, 512), ck.tokenizer


def turns(teacher, openers, seed):
    model, tok = teacher
    s = GenSettings(user_max_tokens=40, batch_size=16)
    gen = torch.Generator().manual_seed(seed)
    return user_turns(model, ChatFormat(tok), 12, s, gen, openers=openers, seed=seed)


def test_requests_start_with_their_openers(teacher):
    openers = ("Write a poem about", "Solve", "Pretend you are")
    got = turns(teacher, openers, seed=1)
    assert len(got) >= 6
    starts = [next((o for o in openers if r.startswith(o)), None) for r in got]
    assert None not in starts  # every request begins with an opener ...
    assert all(len(r) > len(o) + 4 for r, o in zip(got, starts))  # ... that the target continued
    assert len(set(starts)) >= 2  # several kinds


def test_openers_are_seeded_and_the_default_set_is_broad(teacher):
    assert turns(teacher, TASK_OPENERS, seed=3) == turns(teacher, TASK_OPENERS, seed=3)
    assert "" in TASK_OPENERS and len(set(TASK_OPENERS)) >= 30


def test_multiturn_conversations(teacher):
    """Two-turn conversations: each is the templated request, answer and follow-up with the
    generation prompt, then the second answer, scored from there; a held-out row (T = 0) too."""
    from tools.distill.selfinstruct import multiturn

    model, tok = teacher
    chat = ChatFormat(tok)
    s = GenSettings(user_max_tokens=40, answer_max_tokens=16, batch_size=16)
    gen = torch.Generator().manual_seed(2)
    requests = turns(teacher, ("Explain how", "Write a poem about"), seed=4)[:6]
    out = multiturn(model, chat, requests, s, gen, [0.7] * 5 + [0.0], lambda label, n: None)
    assert len(out) == len(requests)
    done = [(r, item) for r, item in zip(requests, out) if item is not None]
    assert done
    for request, (ids, start) in done:
        text = tok.decode(ids[:start], skip_special_tokens=False)
        assert text.startswith("<|im_start|>user\n" + request)
        assert text.count("<|im_start|>user") >= 2 and text.count("<|im_start|>assistant") >= 2
        assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")  # the second answer's
        assert 0 < start < len(ids)
