"""The OpenAI API's request bodies (pydantic) and its response, chunk and error bodies.

Supported: ``max_tokens`` (``max_completion_tokens``), ``temperature``, ``top_p``, ``seed``,
``stop``, ``n`` = 1, ``stream`` (+ ``stream_options.include_usage``); vLLM's extensions ``top_k``
and ``ignore_eos``. Other OpenAI fields are accepted and ignored.
"""

from __future__ import annotations

import time
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field

# OpenAI's finish reasons for the engine's
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "abort"}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Union[str, list[dict], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text is supported
            return "".join(p.get("text", "") for p in self.content if p.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Sampling):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for completions


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
