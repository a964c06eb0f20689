"""Rendering a model's chat template.

A chat template is Jinja code that comes with the checkpoint, i.e. untrusted input. It runs in
jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation
of the data passed in), with the same helpers and options Hugging Face transformers gives it
(``raise_exception``, ``strftime_now``, a JSON-faithful ``tojson``, ``trim_blocks`` and
``lstrip_blocks``), so a prompt renders exactly as ``tokenizer.apply_chat_template`` renders it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ssdlib.errors import SSDError


class _TemplateRaised(TemplateError):
    """``raise_exception(...)`` called by the template itself (e.g. "roles must alternate")."""


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute access fails at once.

    jinja2 would otherwise turn ``''.__class__`` into an undefined value that renders as an empty
    string, so a malicious template would fail silently or not at all.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")


class _Namespace(jinja2.utils.Namespace):
    """``namespace()`` that refuses underscore-prefixed names (a path to CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(
                f"chat templates cannot set underscore names on a namespace ({name!r})")


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = _ChatSandbox(trim_blocks=True, lstrip_blocks=True,
                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _plain_dict
    try:
        return env.from_string(template)
    except TemplateError as e:
        raise SSDError(f"chat template does not compile: {e}") from None


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]],
                         add_generation_prompt: bool = True, **variables: Any) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with ``template``.

    ``variables`` become template variables as well (``bos_token``, ``eos_token``, ``tools``, ...).
    Any failure, including a sandbox violation or the template's own ``raise_exception``, is an
    :class:`SSDError` whose message says what went wrong.
    """
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise SSDError(f"chat message {i} must be a mapping with a 'role' key, got {message!r}")
    compiled = _compile(template)
    plain_messages = [dict(m) for m in messages]
    context = {"tools": None, "documents": None, **variables}
    try:
        return compiled.render(messages=plain_messages, add_generation_prompt=add_generation_prompt,
                               **context)
    except _TemplateRaised as e:
        raise SSDError(f"chat template rejected the conversation: {e}") from None
    except SecurityError as e:
        raise SSDError(f"chat template blocked by the sandbox: {e}") from None
    except TemplateError as e:
        raise SSDError(f"chat template failed to render: {e}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
        # Python errors raised by template code (``'a' + 1``, ``x[99]``): still a bad template.
        raise SSDError(f"chat template failed to render: {type(e).__name__}: {e}") from None
