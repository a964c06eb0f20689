"""Rendering a model's chat template.

A chat template is Jinja code that comes with the checkpoint, i.e. untrusted input. It runs in
jinja2's ``ImmutableSandboxedEnvironment`` (no attribute access to Python internals, no mutation
of the data passed in), with the same helpers and options Hugging Face transformers gives it
(``raise_exception``, ``strftime_now``, a JSON-faithful ``tojson``, ``trim_blocks`` and
``lstrip_blocks``), so a prompt renders exactly as ``tokenizer.apply_chat_template`` renders it.

Rendering is also bounded (see :mod:`ssdlib.tokenizer.template_bounds`), so a hostile template
cannot hang or exhaust memory: it may run for ``MAX_RENDER_S`` seconds and build no string, list
or output weighing more than ``MAX_OUTPUT_CHARS`` characters. Every failure is one
:class:`ConfigError` whose message says what went wrong (a template that does not compile at all
is a :class:`CheckpointError`).

``template_literals`` lets a caller rewrite strings in the template's own text (its literal text
and string constants) but not in the data it renders: the tokenizer uses it to tell the special
tokens a template writes from the same strings inside message contents.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from ssdlib.errors import CheckpointError, ConfigError
from ssdlib.tokenizer import template_bounds as tb
from ssdlib.tokenizer import template_checks as tc

# One rendering may take this long (wall clock) ...
MAX_RENDER_S = 2.0
# ... and build no string or list longer than this (the prompt itself included).
MAX_OUTPUT_CHARS = 1 << 22


class _TemplateRaised(TemplateError):
    """``raise_exception(...)`` called by the template itself (e.g. "roles must alternate")."""


class _ReplaceLiterals(NodeTransformer):
    """Rewrites strings in the template's literal text and string constants (longest first)."""

    def __init__(self, literals: Mapping[str, str]):
        self.literals = literals
        self.pattern = re.compile("|".join(
            re.escape(s) for s in sorted(literals, key=len, reverse=True)))

    def _sub(self, text: str) -> str:
        return self.pattern.sub(lambda m: self.literals[m.group(0)], text)

    def visit_TemplateData(self, node: nodes.TemplateData) -> nodes.TemplateData:
        node.data = self._sub(node.data)
        return node

    def visit_Const(self, node: nodes.Const) -> nodes.Const:
        if isinstance(node.value, str):
            node.value = self._sub(node.value)
        return node


class _ChatSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox, but an unsafe attribute access fails at once, and every loop,
    call, filter, lookup and operator is bounded (see :mod:`ssdlib.tokenizer.template_bounds`).

    jinja2 would otherwise turn ``''.__class__`` into an undefined value that renders as an empty
    string, so a malicious template would fail silently or not at all.
    """

    intercepted_binops = frozenset(["*", "**", "+", "%"])
    # the output of macros and of {% set %} / {% filter %} / {% call %} blocks
    concat = staticmethod(tb.bounded_join)

    def __init__(self, literals: Mapping[str, str], **options: Any):
        # every {{ ... }} is measured before it is turned into text
        super().__init__(finalize=self._finalize, **options)
        self.literals = literals

    @staticmethod
    def _finalize(value: Any) -> Any:
        tb.tick()
        return tb.check_weight(value, "an output")

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed")

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        if self.literals:
            tree = _ReplaceLiterals(self.literals).visit(tree)
        tree = tb.BoundNodes().visit(tree)
        tree.set_environment(self)
        return tree

    def getattr(self, obj: Any, attribute: str) -> Any:
        tb.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        tb.tick()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        tb.tick()
        tc.check_binop(operator, left, right)  # the result is measured before it is built
        return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def checked(*args: Any, **kwargs: Any) -> str:
            tc.check_format(fmt, kwargs or (args[0] if value.__name__ == "format_map" and args
                                            else args))
            return wrapped(*args, **kwargs)

        return checked

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        tb.tick()
        for v in (*args, *kwargs.values()):
            tb.size(tb.length(v), "an argument")
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):  # str methods: no padding/width beyond the size bound
            tc.check_str_method(owner, __obj.__name__, args, kwargs)
        return tb.bounded_result(super().call(__context, __obj, *args, **kwargs),
                                 "a call's result")


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
        tb.check_weight(value, "a namespace value")
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
    tc.checked_tojson_size(value, indent, separators)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _plain_dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)


_CHECKED_FILTERS = {"tojson": _tojson, "center": tc.checked_center, "indent": tc.checked_indent,
                    "format": tc.checked_format, "join": tc.checked_join,
                    "replace": tc.checked_replace, "batch": tc.checked_batch,
                    "slice": tc.checked_slice, "wordwrap": tc.checked_wordwrap,
                    "pprint": tc.checked_pprint, "sum": tc.checked_sum}


@lru_cache(maxsize=16)
def _compile(template: str, literals: tuple[tuple[str, str], ...]) -> jinja2.Template:
    env = _ChatSandbox(dict(literals), trim_blocks=True, lstrip_blocks=True,
                       extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _plain_dict
    del env.globals["lipsum"]  # unbounded text generator, never used by chat templates
    del env.filters["urlize"]  # its attributes are repeated per URL; never used by chat templates
    env.filters.update(_CHECKED_FILTERS)
    for name, func in list(env.filters.items()):  # every filter checks the deadline and its result
        env.filters[name] = tb.bounded_filter(func)
    env.filters["ssd_bounded_loop"] = tb.bounded_loop
    env.filters["ssd_bounded_concat"] = tb.bounded_concat
    env.filters["ssd_bounded_build"] = tb.bounded_build
    return env.from_string(template)


def render_chat_template(template: str, messages: Sequence[Mapping[str, Any]],
                         add_generation_prompt: bool = True, *,
                         template_literals: Mapping[str, str] | None = None,
                         **variables: Any) -> str:
    """Render ``messages`` (``[{"role": ..., "content": ...}, ...]``) with ``template``.

    ``variables`` become template variables as well (``bos_token``, ``eos_token``, ``tools``, ...).
    ``template_literals`` maps strings of the template's own text to what to write instead (see
    the module docstring). Any failure, including a sandbox violation, a bound of the rendering
    or the template's own ``raise_exception``, is a :class:`ConfigError` whose message says what
    went wrong.
    """
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ConfigError(f"chat message {i} must be a mapping with a 'role' key, got "
                              f"{message!r}")
    plain_messages = [dict(m) for m in messages]
    context = {"tools": None, "documents": None, **variables}
    literals = tuple(sorted((template_literals or {}).items()))
    # compiling folds constant expressions, so it runs under the bounds as well
    with tb.Budget(MAX_RENDER_S, MAX_OUTPUT_CHARS) as budget:
        try:
            compiled = _compile(template, literals)
        except TemplateError as e:
            raise CheckpointError(f"chat template does not compile: {e}") from None
        try:
            pieces, total = [], 0
            for piece in compiled.generate(messages=plain_messages,
                                           add_generation_prompt=add_generation_prompt,
                                           **context):
                total += len(piece)
                budget.size(total, "the rendered prompt")
                pieces.append(piece)
            return "".join(pieces)
        except _TemplateRaised as e:
            raise ConfigError(f"chat template rejected the conversation: {e}") from None
        except tb.TemplateLimit as e:
            raise ConfigError(f"chat template stopped: {e} (a template must render a prompt "
                              "quickly and compactly)") from None
        except (MemoryError, RecursionError) as e:
            raise ConfigError(f"chat template stopped: {type(e).__name__} while rendering") \
                from None
        except SecurityError as e:
            raise ConfigError(f"chat template blocked by the sandbox: {e}") from None
        except TemplateError as e:
            raise ConfigError(f"chat template failed to render: {e}") from None
        except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError) as e:
            # Python errors raised by template code (``'a' + 1``, ``x[99]``): still a bad
            # template.
            raise ConfigError(f"chat template failed to render: {type(e).__name__}: {e}") \
                from None
