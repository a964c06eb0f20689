"""The text a Sequence streams (what the server's stream and the CLIs show) never contains a part
of a stop string that the final text drops, and adds up to the final text however it stops."""

from __future__ import annotations

import pytest
import torch

from ssdlib.engine.leader.sequence import Request, Sequence
from ssdlib.sampling import SamplingParams
from ssdlib.tokenizer import load_tokenizer_dir
from tests.tiny_chat import write_char_tokenizer


@pytest.fixture(scope="module")
def char_tokenizer(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("chars"))
    write_char_tokenizer(directory)
    return load_tokenizer_dir(directory)


def _stream(tokenizer, text: str, **params) -> tuple[list[str], str, str]:
    """Commit ``text`` one token at a time: (streamed deltas, final text, finish reason)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    seq = Sequence(Request(0, [1], SamplingParams(**params)), 0, tokenizer.eos_token_ids,
                   tokenizer, torch.device("cpu"))
    deltas = []
    for t in ids:
        seq.commit([t])
        deltas.append(seq.take_text_delta())
        if seq.finished:
            break
    return deltas, seq.final_text(), seq.finish_reason


def test_stream_never_shows_the_start_of_a_stop_string(char_tokenizer):
    deltas, final, reason = _stream(char_tokenizer, "Hello! How can I help?", stop=["ow ca"])
    assert (final, reason) == ("Hello! H", "stop")
    assert "".join(deltas) == final
    shown = ""
    for d in deltas:  # at every point, what was shown is a prefix of the final text
        shown += d
        assert final.startswith(shown), shown


@pytest.mark.parametrize("text, stop", [
    ("Hello! How are you?", ["ow ca"]),  # a held-back "ow" that is no stop after all
    ("Hello! How", ["ow ca"]),           # the answer ends while "ow" is held back
    ("abab", ["abc", "bx"]),
    ("Sure.\n", ["\n\n"]),
])
def test_held_back_text_comes_once_decided(char_tokenizer, text, stop):
    deltas, final, reason = _stream(char_tokenizer, text, stop=stop, max_new_tokens=len(text),
                                    ignore_eos=True)
    assert (final, reason) == (text, "length")
    assert "".join(deltas) == final
