"""Chat templates render as transformers renders them, inside a sandbox that stops template code
from reaching Python internals."""

from __future__ import annotations

import pytest

from ssdlib.errors import SSDError
from ssdlib.tokenizer.chat_template import render_chat_template

CONVERSATION = [
    {"role": "user", "content": "What is speculative decoding?"},
    {"role": "assistant", "content": "A draft model proposes tokens; the target verifies them."},
    {"role": "user", "content": "Why is it faster? Answer in one line 🤗."},
]


def test_two_turn_conversation_equals_transformers(smollm2_tokenizer, hf_smollm2_tokenizer):
    for messages in (CONVERSATION, [{"role": "system", "content": "Be brief."}, *CONVERSATION]):
        expected = hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                            add_generation_prompt=True)
        assert smollm2_tokenizer.apply_chat_template(messages) == expected
        assert smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=False) == (
            hf_smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=False))
    prompt = smollm2_tokenizer.apply_chat_template(CONVERSATION)
    assert smollm2_tokenizer.encode(prompt, add_special_tokens=False) == (
        hf_smollm2_tokenizer.apply_chat_template(CONVERSATION, tokenize=True,
                                                 add_generation_prompt=True, return_dict=False))


def test_helpers_like_transformers():
    template = ("{{ bos_token }}{{ messages | tojson }}{{ strftime_now('%Y') | length }}"
                "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
                "{% endfor %}{{ ns.n }}")
    out = render_chat_template(template, [{"role": "user", "content": "é<b>"}], bos_token="<s>")
    assert out == '<s>[{"role": "user", "content": "é<b>"}]41'


@pytest.mark.parametrize("template, message", [
    ("{{ ''.__class__.__mro__ }}", "sandbox.*'__class__'"),
    ("{{ messages.__class__.__base__.__subclasses__() }}", "sandbox.*'__class__'"),
    ("{{ raise_exception.__globals__ }}", "sandbox.*'__globals__'"),
    ("{{ cycler.__init__.__globals__.os }}", "sandbox.*'__init__'"),
    ("{% set ns = namespace() %}{% set ns._secret = 1 %}", "sandbox.*underscore"),
    ("{{ messages.append(1) }}", "sandbox|unsafe|not safely callable"),
])
def test_sandbox_blocks_escapes(template, message):
    with pytest.raises(SSDError, match=message):
        render_chat_template(template, CONVERSATION)


def test_template_errors_are_clear():
    with pytest.raises(SSDError, match="rejected the conversation: roles must alternate"):
        render_chat_template("{{ raise_exception('roles must alternate') }}", CONVERSATION)
    with pytest.raises(SSDError, match="does not compile"):
        render_chat_template("{% for %}", CONVERSATION)
    with pytest.raises(SSDError, match="mapping with a 'role'"):
        render_chat_template("{{ messages }}", ["not a message"])


def test_no_template_is_a_clear_error(smollm2_tokenizer):
    from ssdlib.tokenizer import Tokenizer

    plain = Tokenizer(smollm2_tokenizer.backend, bos_token_id=None, eos_token_ids=[0])
    with pytest.raises(SSDError, match="no chat template"):
        plain.apply_chat_template(CONVERSATION)
