"""Checks made before a template operation that can build more than it is given runs:
repetition, concatenation, formatting, padding, indenting, joining, replacing, serialising.
Each refuses (:class:`~ssdlib.tokenizer.template_bounds.TemplateLimit`) what would be over the
cap of :mod:`ssdlib.tokenizer.template_bounds` before anything is built."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sized
from typing import Any

import jinja2
from jinja2.filters import (do_batch, do_center, do_format, do_indent, do_join, do_pprint,
                            do_replace, do_slice, do_sum, do_wordwrap, make_attrgetter)

from ssdlib.tokenizer.template_bounds import length, shape, size, tick, weight

# the field specs of printf-style ("%-10.3f") and str.format-style ("{0:>10}") templates
_PRINTF_SPEC = re.compile(r"%[#0\- +]*(\d*)(?:\.(\d*))?")
_FORMAT_SPEC = re.compile(r"\{[^{}]*?:([^{}]*)\}")
_DIGITS = re.compile(r"\d+")
_NESTED_SPEC = re.compile(r"\{[^{}]*:[^{}]*\{")


def check_format(fmt: str, args: Any) -> None:
    """``fmt % args`` / ``fmt.format(...)``: no field width or precision beyond the cap, and no
    result beyond it (``'%(a)s%(a)s...' % {'a': long}`` prints its argument once per field)."""
    numbers = [n for m in _PRINTF_SPEC.finditer(fmt) for n in m.groups() if n]
    numbers += [n for m in _FORMAT_SPEC.finditer(fmt) for n in _DIGITS.findall(m.group(1))]
    for number in numbers:
        size(float("inf") if len(number) > 12 else int(number), "a formatted field")
    values = list(args.values()) if isinstance(args, Mapping) else \
        list(args) if isinstance(args, (tuple, list)) else [args]
    if "*" in fmt or _NESTED_SPEC.search(fmt):  # widths taken from the arguments
        for v in values:
            if isinstance(v, int) and not isinstance(v, bool):
                size(abs(v), "a formatted field")
    fields = fmt.count("%") + fmt.count("{")
    size(len(fmt) + fields * max((weight(v) for v in values), default=0), "a formatted string")


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse ``left <operator> right`` before it runs when its result would be over the cap."""
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            size((left.bit_length() + right.bit_length()) / 8, "a number")
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, bytes, list, tuple)) and isinstance(n, int):
                size(weight(seq) * n if seq else 0, "a repeated string or list")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            size(right * abs(left).bit_length() / 8, "a number")
    elif operator == "+":
        if length(left) and length(right):
            size(weight(left) + weight(right), "a concatenation")
    elif operator == "%" and isinstance(left, str):
        check_format(left, right)


def check_str_method(owner: str, name: str, args: tuple, kwargs: dict) -> None:
    """A call of a str method: no padding, tab width or replacement beyond the cap."""
    values = (*args, *kwargs.values())
    for v in values:
        if isinstance(v, int) and not isinstance(v, bool):
            size(abs(v), f"the result of str.{name}")
    if name == "replace" and len(args) >= 2:
        size((len(owner) + 1) * length(args[1]) + len(owner), "a replaced string")
    elif name == "join" and args and isinstance(args[0], Sized):
        size(len(owner) * len(args[0]) + weight(args[0]), "a joined string")
    elif name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        if isinstance(tab, int):
            size(len(owner) + owner.count("\t") * tab, "an expanded string")
    elif name == "translate" and args and isinstance(args[0], Mapping):
        longest = max((length(v) for v in args[0].values()), default=0)
        size(len(owner) * max(longest, 1), "a translated string")



# -- filters that can build more than they are given ------------------------------------------
def checked_center(value: Any, width: int = 80) -> str:
    size(width if isinstance(width, int) else 0, "a centered string")
    return do_center(value, width)


def checked_indent(s: str, width: int | str = 4, first: bool = False,
                   blank: bool = False) -> str:
    pad = width if isinstance(width, int) else len(str(width))
    size(length(s) + (str(s).count("\n") + 1) * pad, "an indented string")
    return do_indent(s, width, first, blank)


def checked_format(value: str, *args: Any, **kwargs: Any) -> str:
    check_format(str(value), kwargs or args)
    return do_format(value, *args, **kwargs)


@jinja2.pass_eval_context
def checked_join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    if isinstance(value, Sized):
        size(len(str(d)) * len(value) + weight(value), "a joined string")
    return do_join(eval_ctx, value, d, attribute)


@jinja2.pass_eval_context
def checked_replace(eval_ctx: Any, s: str, old: str, new: str, count: int | None = None) -> str:
    size((length(s) + 1) * len(str(new)) + length(s), "a replaced string")
    return do_replace(eval_ctx, s, old, new, count)


def checked_batch(value: Any, linecount: int, fill_with: Any = None) -> Any:
    size(linecount if isinstance(linecount, int) else 0, "a batch")
    return do_batch(value, linecount, fill_with)


def checked_slice(value: Any, slices: int, fill_with: Any = None) -> Any:
    size(slices if isinstance(slices, int) else 0, "a slice count")
    return do_slice(value, slices, fill_with)


@jinja2.pass_environment
def checked_wordwrap(environment: Any, s: str, width: int = 79, break_long_words: bool = True,
                     wrapstring: str | None = None, break_on_hyphens: bool = True) -> str:
    # at most one break per character, each adding the wrap string
    size(length(s) * (1 + len(str(wrapstring or "\n"))), "a wrapped string")
    return do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)


def checked_pprint(value: Any) -> str:
    w, items, depth = shape(value)
    size(w + items * depth, "a pretty-printed value")  # at most one line per item, indented
    return do_pprint(value)


@jinja2.pass_environment
def checked_sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """``sum``; summing lists copies the total at each step, so that is done here, step by step,
    with the deadline and the cap checked at each one."""
    if isinstance(start, (int, float)):
        return do_sum(environment, iterable, attribute, start)
    if attribute is not None:
        iterable = map(make_attrgetter(environment, attribute), iterable)
    total, total_weight = start, weight(start)
    for item in iterable:
        tick()
        total_weight += weight(item)
        size(total_weight, "a sum")
        total = total + item
    return total


def checked_tojson_size(value: Any, indent: Any, separators: Any) -> None:
    """``tojson``: each item adds a separator and, with ``indent``, an indent per level."""
    w, items, depth = shape(value)
    pad = indent if isinstance(indent, int) and not isinstance(indent, bool) else \
        len(indent) if isinstance(indent, str) else 0
    sep = max((length(s) for s in separators), default=2) if isinstance(
        separators, (tuple, list)) else 2
    size(pad, "a JSON indent")
    size(w + items * (sep + 2 + pad * depth), "a JSON string")
