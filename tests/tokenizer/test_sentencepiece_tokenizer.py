"""Sentencepiece-style (Llama 2) tokenizers: from a GGUF ``llama`` vocabulary and from a
``tokenizer.model``, compared with transformers and with sentencepiece itself. The model is a tiny
BPE model with byte fallback trained here in milliseconds."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest

from ssdlib.tokenizer import load_tokenizer_dir, tokenizer_from_gguf
from ssdlib.tokenizer.sentencepiece_model import read_sentencepiece_model

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Hello world! Héllo wörld, naïve café.",
          "def f(x):\n    return x * 2  # comment", "日本語のテキストも少し。",
          "numbers 12345 and 3.14159"] * 40
TEXTS = ["Hello world", "The  quick\n\nfox 12345", "naïve café <tool> x", "emoji 🤗 never seen",
         "日本 and Ωmega", "a<s>b</s>c"]


@pytest.fixture(scope="module")
def sp_files(tmp_path_factory):
    """(directory with tokenizer.model, GGUF file with the same vocabulary, sentencepiece proc)."""
    sentencepiece = pytest.importorskip("sentencepiece")
    gguf = pytest.importorskip("gguf")
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS), model_writer=model, vocab_size=400, model_type="bpe",
        byte_fallback=True, character_coverage=1.0, user_defined_symbols=["<tool>"],
        split_digits=True, allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
        normalization_rule_name="identity", minloglevel=2)
    directory = tmp_path_factory.mktemp("sp")
    sp_path = os.path.join(directory, "tokenizer.model")
    with open(sp_path, "wb") as f:
        f.write(model.getvalue())
    parsed = read_sentencepiece_model(sp_path)
    gguf_dir = tmp_path_factory.mktemp("sp-gguf")
    writer = gguf.GGUFWriter(os.path.join(gguf_dir, "sp.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(parsed.pieces)
    writer.add_token_scores(parsed.scores)
    writer.add_token_types(parsed.types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_tensor("token_embd.weight", np.zeros((len(parsed.pieces), 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    proc = sentencepiece.SentencePieceProcessor(model_file=sp_path)
    return str(directory), os.path.join(gguf_dir, "sp.gguf"), proc


def test_model_file_reader(sp_files):
    directory, _, proc = sp_files
    parsed = read_sentencepiece_model(os.path.join(directory, "tokenizer.model"))
    assert parsed.pieces == [proc.IdToPiece(i) for i in range(proc.GetPieceSize())]
    assert parsed.scores == pytest.approx([proc.GetScore(i) for i in range(proc.GetPieceSize())])
    assert parsed.types[:4] == [2, 3, 3, 4]  # <unk>, <s>, </s>, user-defined <tool>
    assert all(parsed.types[i] == 6 for i in range(4, 260))  # the 256 byte-fallback pieces


def test_gguf_llama_vocab_equals_transformers(sp_files):
    from transformers import AutoTokenizer

    _, gguf_path, proc = sp_files
    ours = tokenizer_from_gguf(gguf_path)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                       gguf_file=os.path.basename(gguf_path))
    assert json.loads(ours.backend.to_str()) == json.loads(hf.backend_tokenizer.to_str())
    for text in TEXTS + [" leading space"]:
        assert ours.encode(text) == hf.encode(text)
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    # Where transformers and sentencepiece agree (no leading whitespace; sentencepiece reads
    # "<s>" in text as characters), so do we.
    for text in TEXTS[:-1]:
        assert ours.encode(text) == [proc.bos_id(), *proc.encode(text)]
    assert ours.bos_token_id == 1 and ours.eos_token_ids == [2]


def test_tokenizer_model_dir_matches_gguf(sp_files, tmp_path):
    directory, gguf_path, _ = sp_files
    from_dir = load_tokenizer_dir(directory)
    from_gguf = tokenizer_from_gguf(gguf_path)
    for text in TEXTS:
        assert from_dir.encode(text) == from_gguf.encode(text)
    # No tokenizer_config.json: ids come from the model, BOS is added as for Llama.
    assert from_dir.encode("Hello")[0] == 1
    assert load_tokenizer_dir(str(tmp_path)) is None  # no tokenizer files at all


@pytest.mark.parametrize("text", TEXTS + ["  two leading spaces", "🤗🤗 done"])
def test_stream_decoder_sentencepiece(sp_files, text):
    tok = tokenizer_from_gguf(sp_files[1])
    ids = tok.encode(text)
    stream = tok.stream_decoder()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == tok.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def test_save_hf_with_bos_loads_in_transformers(sp_files, tmp_path):
    from transformers import AutoTokenizer

    ours = tokenizer_from_gguf(sp_files[1])
    assert ours.add_bos_token
    ours.save_hf(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    reloaded = load_tokenizer_dir(str(tmp_path))
    for text in TEXTS:
        assert hf.encode(text) == ours.encode(text) == reloaded.encode(text)
        assert ours.encode(text)[0] == 1
    assert reloaded.fingerprint() == ours.fingerprint()


@pytest.mark.parametrize("where", ["config_list", "jinja_file", "json_file"])
def test_chat_template_locations(sp_files, tmp_path, where):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}</s>{% endfor %}"
    tokenizer_from_gguf(sp_files[1]).save_hf(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    if where == "config_list":
        config["chat_template"] = [{"name": "tool_use", "template": "x"},
                                   {"name": "default", "template": template}]
    elif where == "jinja_file":
        (tmp_path / "chat_template.jinja").write_text(template)
    else:
        (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    config_path.write_text(json.dumps(config))
    tok = load_tokenizer_dir(str(tmp_path))
    assert tok.chat_template == template
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[user] hi</s>"
    # "</s>" is the EOS already; no end-of-turn marker of the known kinds is added.
    assert tok.eos_token_ids == [2]


def test_chat_content_is_plain_text(sp_files):
    """With a sentencepiece tokenizer (whose first piece of text gets a leading "▁"), a chat
    prompt encodes as the rendered text does, except that "</s>" typed in a message stays text."""
    tok = tokenizer_from_gguf(sp_files[1])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] "
                         "{{ m['content'] }}</s>{% endfor %}")
    eos = tok.token_to_id("</s>")
    for content in ("Hello world", " naïve café <tool> x", "日本 and Ωmega"):
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}]
        assert tok.encode_chat(messages) == tok.encode(tok.apply_chat_template(messages),
                                                       add_special_tokens=False)
    messages = [{"role": "user", "content": "a</s><s>b"}]
    ids = tok.encode_chat(messages)
    assert ids.count(eos) == 1 and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids, skip_special_tokens=False).count("</s>") == 2  # one as plain text
    assert tok.encode_chat(messages, allow_special_tokens_in_content=True).count(eos) == 2
