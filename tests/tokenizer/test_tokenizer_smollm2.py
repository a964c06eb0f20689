"""SmolLM2's byte-level BPE tokenizer rebuilt from GGUF metadata, compared with transformers'
``AutoTokenizer.from_pretrained(dir, gguf_file=...)``."""

from __future__ import annotations

import json

import pytest

TEXTS = [
    "Hello world",
    "",
    " leading space and trailing space ",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 한국어, عربى",
    "emoji 🤗👩‍👩‍👧 ❤️ 🇫🇷 and a lone surrogate-free ✓",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "whitespace runs:  two   three    four\t\ttabs\n\n\nnewlines \r\n crlf   1",
    "numbers 12345 3.14159 1,000,000 x=   5",
    "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>ssdlib<file_sep>README.md",
    "I'm sure it's what they'd've said; we'll see. DON'T",
    "https://example.com/a?b=c&d=e#frag   {\"json\": [1, 2, null]}",
]


def test_pipeline_equals_transformers(smollm2_tokenizer, hf_smollm2_tokenizer):
    ours = json.loads(smollm2_tokenizer.backend.to_str())
    theirs = json.loads(hf_smollm2_tokenizer.backend_tokenizer.to_str())
    assert ours == theirs


@pytest.mark.parametrize("text", TEXTS)
def test_ids_equal_transformers(smollm2_tokenizer, hf_smollm2_tokenizer, text):
    assert smollm2_tokenizer.encode(text) == hf_smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.encode(text, add_special_tokens=False) == hf_smollm2_tokenizer.encode(
        text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(smollm2_tokenizer, hf_smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=False) == text
    assert smollm2_tokenizer.decode(ids) == hf_smollm2_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_stream_decoder_concatenates_to_decode(smollm2_tokenizer, text):
    ids = smollm2_tokenizer.encode(text)
    for skip in (True, False):
        stream = smollm2_tokenizer.stream_decoder(skip_special_tokens=skip)
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == smollm2_tokenizer.decode(ids, skip)
        assert not any("\ufffd" in p for p in pieces)


def test_stream_decoder_holds_back_split_characters(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("🤗")
    assert len(ids) > 1  # one emoji, several byte-level tokens
    stream = smollm2_tokenizer.stream_decoder()
    assert [stream.push(i) for i in ids] == [""] * (len(ids) - 1) + ["🤗"]
    stream = smollm2_tokenizer.stream_decoder()
    stream.push(ids[0])
    assert stream.flush() == "\ufffd"  # an unfinished character is not lost at the end


def test_special_ids_and_vocab(smollm2_tokenizer, hf_smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.vocab_size == 49152 == len(hf_smollm2_tokenizer)
    assert tok.bos_token_id == hf_smollm2_tokenizer.bos_token_id == 1
    assert tok.eos_token_ids == [hf_smollm2_tokenizer.eos_token_id] == [2]
    assert tok.get_vocab() == hf_smollm2_tokenizer.get_vocab()
    assert tok.chat_template == hf_smollm2_tokenizer.chat_template


def test_fingerprint(smollm2_tokenizer):
    from ssdlib.tokenizer import Tokenizer

    fp = smollm2_tokenizer.fingerprint()
    same = Tokenizer(smollm2_tokenizer.backend, bos_token_id=1, eos_token_ids=[2])
    assert len(fp) == 64 and same.fingerprint() == fp
    assert Tokenizer(smollm2_tokenizer.backend, bos_token_id=1, eos_token_ids=[0]).fingerprint() != fp


def test_save_hf_loads_in_transformers(smollm2_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    from ssdlib.tokenizer import load_tokenizer_dir

    smollm2_tokenizer.save_hf(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    reloaded = load_tokenizer_dir(str(tmp_path))
    for text in TEXTS:
        assert hf.encode(text) == smollm2_tokenizer.encode(text)
        assert reloaded.encode(text) == smollm2_tokenizer.encode(text)
    assert hf.bos_token_id == 1 and hf.eos_token_id == 2
    assert reloaded.fingerprint() == smollm2_tokenizer.fingerprint()
    assert reloaded.chat_template == smollm2_tokenizer.chat_template
