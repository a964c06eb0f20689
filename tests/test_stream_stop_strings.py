"""Streaming with stop strings, through the Generator the CLIs use: the text handed to
``on_text`` adds up to the final answer, so no part of a stop string is ever shown."""

from __future__ import annotations

import pytest

from ssdlib import Generator, SamplingParams
from tests.tiny_chat import make_tiny_chat_model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("stopstream") / "m"))


def test_streamed_text_stops_where_the_answer_stops(chat_model):
    prompt = {"prompt": "Tell me a story."}
    base = dict(max_new_tokens=24, ignore_eos=True, temperature=1.0, seed=3)
    with Generator(target=chat_model, max_len=128) as g:
        plain = g.generate([prompt], SamplingParams(**base))[0].text
        # a stop string that arrives over several tokens (this tokenizer: one per character),
        # first seen after the answer's start
        stop = next(plain[i:i + 3] for i in range(1, len(plain) - 3)
                    if plain.find(plain[i:i + 3]) == i)
        cut = plain.find(stop)
        chunks: list[str] = []
        out = g.generate([prompt], SamplingParams(stop=[stop], **base),
                         on_text=lambda i, d: chunks.append(d))[0]
    assert (out.text, out.finish_reason) == (plain[:cut], "stop")
    assert "".join(chunks) == out.text, (chunks, stop)
