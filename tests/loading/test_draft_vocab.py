"""A draft with the target's tokenizer but fewer embedding rows is refused at load, before any
rank starts; otherwise it would crash on the first token id beyond its vocabulary."""

import pytest

from ssdlib import Generator
from ssdlib.errors import CheckpointError
from ssdlib.loading import load_checkpoint
from ssdlib.loading.compat import check_draft_compatible
from tests.tiny_chat import make_tiny_chat_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab")
    target = make_tiny_chat_model(str(root / "target"), vocab_size=90)
    small = make_tiny_chat_model(str(root / "small"), vocab_size=80, seed=1)
    large = make_tiny_chat_model(str(root / "large"), vocab_size=96, seed=2)
    return target, small, large


def test_same_tokenizer_fewer_rows_is_refused(pair):
    target, small, large = pair
    t, s = load_checkpoint(target), load_checkpoint(small)
    assert t.tokenizer.fingerprint() == s.tokenizer.fingerprint()
    with pytest.raises(CheckpointError, match="80 embedding rows.*up to 89"):
        check_draft_compatible(t, s)
    check_draft_compatible(t, load_checkpoint(large))  # more rows: the extra logits are cut


@pytest.mark.parametrize("kw", [dict(mode="sd"), dict(mode="ssd")], ids=["sd", "ssd"])
def test_generator_refuses_the_pair_before_starting_ranks(pair, kw, monkeypatch):
    import ssdlib.generator as generator

    def no_ranks(*a, **k):
        raise AssertionError("ranks started for a pair that cannot work")

    monkeypatch.setattr(generator, "RankGroup", no_ranks)
    monkeypatch.setattr(generator, "build_rank", no_ranks)
    target, small, _ = pair
    with pytest.raises(CheckpointError, match="embedding rows"):
        Generator(target=target, draft=small, max_len=64, **kw)
