"""The OpenAI API's request bodies (pydantic) and its response, chunk and error bodies.

Supported: ``max_tokens`` (``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``,
``stop``, ``n`` = 1, ``stream`` (+ ``stream_options.include_usage``); vLLM's extensions ``top_k``
and ``ignore_eos``. Fields that would change the answer and that the engine does not implement
(``UNSUPPORTED``: log-probabilities, logit bias, penalties, tools, response formats, echo,
best_of, suffix, vLLM's guided decoding) are refused with a 400 naming the field when a request
sets them to anything but their neutral value, rather than answered as if they were absent.
Other fields (``user``, ``metadata``, ``store``, ...) change nothing and are ignored.

The known fields are validated strictly, so a request is refused (400) rather than reinterpreted:
no booleans or strings where numbers are due (``max_tokens: true``), no NaN or Infinity (which
Python's JSON parser accepts), only OpenAI's chat roles, only text content parts, only text
that is valid Unicode (no lone surrogates, which JSON's ``\\ud800`` escapes can carry).
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, ConfigDict, Field, ValidationInfo, field_validator,
                      model_validator)

from ssdlib.tokenizer.unicode_text import check_unicode

# OpenAI's finish reasons for the engine's
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


# the chat roles a conversation may hold ("developer" is OpenAI's newer name for "system")
ROLES = ("system", "developer", "user", "assistant", "tool")

# Bounds on what one request may hold. Checked before the models are built: validating a body
# runs on the server's event loop (every stream waits meanwhile), and 8 MiB of tiny messages or
# content parts took over a second to validate. Each stop string is searched for in the text
# after every generated token.
MAX_MESSAGES = 10_000
MAX_CONTENT_PARTS = 10_000  # over all the messages of a request
MAX_STOP = 16

# strict: no coercion (true -> 1, "5" -> 5); allow_inf_nan=False: NaN and Infinity are refused
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

# Fields of OpenAI's API (and vLLM's) that would change the answer and that the engine does not
# implement, with the values that leave the answer as it is (null, false, 0, empty, ...): any
# other value is refused (400, the field as its param). ``tool_choice`` "auto" / "none" without
# tools changes nothing.
UNSUPPORTED: dict[str, tuple] = {
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "min_p": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,),
    "guided_grammar": (None,),
}


def _neutral(value, neutral: tuple) -> bool:
    # booleans are not numbers here (best_of: true is not best_of: 1); 0 == 0.0 is fine
    return any(value is n if isinstance(n, bool) or n is None or isinstance(value, bool)
               else value == n for n in neutral)


def valid_text(text: str) -> str:
    """``text`` if it is valid Unicode, else a ValueError naming the first lone surrogate."""
    return check_unicode(text, "the text")


class StreamOptions(BaseModel):
    model_config = _STRICT

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: Union[str, Annotated[list[str], Field(max_length=MAX_STOP)], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    # UNSUPPORTED's fields: declared to be checked, refused unless neutral
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    repetition_penalty: Any = None
    min_p: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    echo: Any = None
    best_of: Any = None
    suffix: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _unsupported(cls, value, info: ValidationInfo):
        neutral = UNSUPPORTED[info.field_name]
        if not _neutral(value, neutral):
            shown = " or ".join(json.dumps(n) for n in neutral)  # null, false, {}, "auto"
            raise ValueError(f"not supported by this server (leave it out, or send {shown})")
        return value


class TextPart(BaseModel):
    """A content part; only text is supported (an image part is refused, not dropped)."""
    model_config = _STRICT

    type: Literal["text"]
    text: str

    @field_validator("text")
    @classmethod
    def _unicode(cls, text: str) -> str:
        return valid_text(text)


class ChatMessage(BaseModel):
    model_config = _STRICT

    role: Literal[ROLES]
    content: Union[str, list[TextPart], None] = None

    @field_validator("content")
    @classmethod
    def _unicode(cls, content):
        return valid_text(content) if isinstance(content, str) else content

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data):
        messages = data.get("messages") if isinstance(data, dict) else None
        if isinstance(messages, list):
            if len(messages) > MAX_MESSAGES:
                raise ValueError(f"messages: at most {MAX_MESSAGES} messages per request, got "
                                 f"{len(messages)}")
            parts = sum(len(m["content"]) for m in messages
                        if isinstance(m, dict) and isinstance(m.get("content"), list))
            if parts > MAX_CONTENT_PARTS:
                raise ValueError(f"messages: at most {MAX_CONTENT_PARTS} content parts per "
                                 f"request, got {parts}")
        return data


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions

    @field_validator("prompt")
    @classmethod
    def _unicode(cls, prompt):
        if isinstance(prompt, str):
            return valid_text(prompt)
        for p in prompt:
            if isinstance(p, str):
                valid_text(p)
        return prompt


def error_body(message: str, type_: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, model: str, text: str, finish: str, use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish}],
            "usage": use}


def chat_chunk(rid: str, model: str, delta: dict, finish: str | None,
               use: dict | None = None) -> dict:
    chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
             "model": model, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                          "finish_reason": finish}]}
    if use is not None:
        chunk["choices"], chunk["usage"] = [], use
    return chunk


def completion_response(rid: str, model: str, text: str, finish: str | None,
                        use: dict | None, object_: Literal["text_completion"] = "text_completion"
                        ) -> dict:
    body = {"id": rid, "object": object_, "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body
