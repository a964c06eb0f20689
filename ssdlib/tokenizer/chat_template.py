"""Rendering a model's chat template.

A chat template is Jinja code that comes with the checkpoint, i.e. untrusted input. It runs in
jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation
of the data passed in), with the same helpers and options Hugging Face transformers gives it
(``raise_exception``, ``strftime_now``, a JSON-faithful ``tojson``, ``trim_blocks`` and
``lstrip_blocks``), so a prompt renders exactly as ``tokenizer.apply_chat_template`` renders it.

Rendering is also bounded, so a hostile template cannot hang or exhaust memory: every loop
iteration, call, attribute lookup and operator checks a wall-clock deadline
(``MAX_RENDER_S``), and anything that would build a string or list longer than
``MAX_OUTPUT_CHARS`` (``'a' * 10**10``, ``'x'|center(10**10)``, doubling with ``~``, the output
itself) is refused before it is built. Either way the error is one :class:`SSDError`.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Mapping, Sequence, Sized
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.filters import do_batch, do_center, do_format, do_indent, do_join, do_replace, do_slice
from jinja2.runtime import str_join
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from ssdlib.errors import SSDError


# One rendering may take this long (wall clock) ...
MAX_RENDER_S = 2.0
# ... and build no string or list longer than this (the prompt itself included).
MAX_OUTPUT_CHARS = 1 << 22


class _TemplateRaised(TemplateError):
    """``raise_exception(...)`` called by the template itself (e.g. "roles must alternate")."""


class _TemplateLimit(TemplateError):
    """The template went past the time or size bound of one rendering."""


class _Budget:
    """The bounds of the rendering in progress on this thread."""

    _current = threading.local()

    def __init__(self, seconds: float, max_chars: int):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.max_chars = max_chars

    @classmethod
    def active(cls) -> "_Budget | None":
        return getattr(cls._current, "budget", None)

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise _TemplateLimit(f"rendering took longer than {self.seconds:g} s")

    def size(self, n: float, what: str = "a value") -> None:
        if n > self.max_chars:
            raise _TemplateLimit(f"{what} would be longer than {self.max_chars} characters")


def _tick() -> None:
    budget = _Budget.active()
    if budget is not None:
        budget.tick()


def _size(n: float, what: str = "a value") -> None:
    budget = _Budget.active()
    if budget is not None:
        budget.size(n, what)


def _length(value: Any) -> int:
    return len(value) if isinstance(value, (str, list, tuple, dict)) else 0


# the field specs of printf-style ("%-10.3f") and str.format-style ("{0:>10}") templates
_PRINTF_SPEC = re.compile(r"%[#0\- +]*(\d*)(?:\.(\d*))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_DIGITS = re.compile(r"\d+")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")


def _check_format(fmt: str, args: Any) -> None:
    """``fmt % args`` / ``fmt.format(...)``: no field width or precision beyond the size bound."""
    numbers = [n for m in _PRINTF_SPEC.finditer(fmt) for n in m.groups() if n]
    numbers += [n for m in _FORMAT_SPEC.finditer(fmt) for n in _DIGITS.findall(m.group(1))]
    for number in numbers:
        _size(float("inf") if len(number) > 12 else int(number), "a formatted field")
    values = args.values() if isinstance(args, Mapping) else \
        args if isinstance(args, (tuple, list)) else (args,)
    if "*" in fmt or _NESTED_SPEC.search(fmt):  # widths taken from the arguments
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool):
                _size(abs(v), "a formatted field")


def _bounded_loop(iterable: Any):
    """Wraps every ``{% for %}`` iterable: the deadline is checked at each iteration."""
    for item in iterable:
        _tick()
        yield item


def _bounded_concat(first: Any, *rest: Any) -> str:
    """``a ~ b ~ ...`` with its result size checked before it is joined."""
    parts = [first, *rest]
    _size(sum(len(str(p)) for p in parts), "a joined string")
    return str_join(parts)


def _checked_center(value: Any, width: int = 80) -> str:
    _size(width if isinstance(width, int) else 0, "a centered string")
    return do_center(value, width)


def _checked_indent(s: str, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
    pad = width if isinstance(width, int) else len(str(width))
    _size(_length(s) + (str(s).count("\n") + 1) * pad, "an indented string")
    return do_indent(s, width, first, blank)


def _checked_format(value: str, *args: Any, **kwargs: Any) -> str:
    _check_format(str(value), kwargs or args)
    return do_format(value, *args, **kwargs)


@jinja2.pass_eval_context
def _checked_join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    if isinstance(value, Sized):
        _size(len(str(d)) * len(value), "a joined string")
    return do_join(eval_ctx, value, d, attribute)


@jinja2.pass_eval_context
def _checked_replace(eval_ctx: Any, s: str, old: str, new: str, count: int | None = None) -> str:
    _size((_length(s) + 1) * len(str(new)) + _length(s), "a replaced string")
    return do_replace(eval_ctx, s, old, new, count)


def _checked_batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
    _size(linecount if isinstance(linecount, int) else 0, "a batch")
    return do_batch(value, linecount, fill_with)


def _checked_slice(value: Any, slices: int, fill_with: Any = None) -> Any:
    _size(slices if isinstance(slices, int) else 0, "a slice count")
    return do_slice(value, slices, fill_with)


class _BoundLoops(NodeTransformer):
    """Rewrites a parsed template so that loops and ``~`` go through the bounded helpers."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "ssd_bounded_loop", [], [], None, None,
                                 lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        return nodes.Filter(node.nodes[0], "ssd_bounded_concat", list(node.nodes[1:]), [], None,
                            None, lineno=node.lineno)


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute access fails at once, and every loop,
    call, lookup and operator is bounded (see the module docstring).

    jinja2 would otherwise turn ``''.__class__`` into an undefined value that renders as an empty
    string, so a malicious template would fail silently or not at all.
    """

    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = _BoundLoops().visit(super()._parse(source, name, filename))
        tree.set_environment(self)
        return tree

    def getattr(self, obj: Any, attribute: str) -> Any:
        _tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        _tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _size(len(seq) * n, "a repeated string or list")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                _size(right * math.log2(abs(left)) / 8, "a number")
        elif operator == "+":
            if _length(left) and _length(right):
                _size(_length(left) + _length(right), "a concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_format(left, right)
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_format(fmt, kwargs or (args[0] if value.__name__ == "format_map" and args
                                          else args))
            return wrapped(*args, **kwargs)

        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _tick()
        values = (*args, *kwargs.values())
        for v in values:
            _size(_length(v), "an argument")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):  # str methods: no padding/width beyond the size bound
            for v in values:
                if isinstance(v, int) and not isinstance(v, bool):
                    _size(abs(v), f"the result of str.{__obj.__name__}")
            if __obj.__name__ == "replace" and len(args) >= 2:
                _size((len(owner) + 1) * _length(args[1]) + len(owner), "a replaced string")
            elif __obj.__name__ == "join" and args and isinstance(args[0], Sized):
                _size(len(owner) * len(args[0]), "a joined string")
        return super().call(__context, __obj, *args, **kwargs)


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
        _size(_length(value), "a namespace value")
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
    _size(indent if isinstance(indent, int) else 0, "a JSON indent")
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
    env.filters["ssd_bounded_loop"] = _bounded_loop
    env.filters["ssd_bounded_concat"] = _bounded_concat
    env.filters["center"] = _checked_center
    env.filters["indent"] = _checked_indent
    env.filters["format"] = _checked_format
    env.filters["join"] = _checked_join
    env.filters["replace"] = _checked_replace
    env.filters["batch"] = _checked_batch
    env.filters["slice"] = _checked_slice
    del env.globals["lipsum"]  # unbounded text generator, never used by chat templates
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
    budget = _Budget(MAX_RENDER_S, MAX_OUTPUT_CHARS)
    outer = _Budget.active()
    _Budget._current.budget = budget
    try:
        pieces, total = [], 0
        for piece in compiled.generate(messages=plain_messages,
                                       add_generation_prompt=add_generation_prompt, **context):
            total += len(piece)
            budget.size(total, "the rendered prompt")
            pieces.append(piece)
        return "".join(pieces)
    except _TemplateRaised as e:
        raise SSDError(f"chat template rejected the conversation: {e}") from None
    except _TemplateLimit as e:
        raise SSDError(f"chat template stopped: {e} (a template must render a prompt quickly "
                       "and compactly)") from None
    except (MemoryError, RecursionError) as e:
        raise SSDError(f"chat template stopped: {type(e).__name__} while rendering") from None
    except SecurityError as e:
        raise SSDError(f"chat template blocked by the sandbox: {e}") from None
    except TemplateError as e:
        raise SSDError(f"chat template failed to render: {e}") from None
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
        # Python errors raised by template code (``'a' + 1``, ``x[99]``): still a bad template.
        raise SSDError(f"chat template failed to render: {type(e).__name__}: {e}") from None
    finally:
        _Budget._current.budget = outer
