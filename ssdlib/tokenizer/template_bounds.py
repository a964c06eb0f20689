"""The bounds of one chat-template rendering: a wall-clock deadline and a cap on what it builds.

A template is untrusted code, so its rendering must end quickly whatever it does. Two rules:

- **Everything a template builds is measured before or as it is built.** The measure of a value
  (:func:`weight`) is about the length of its ``str()``, with a shared part counted every time it
  occurs: ``[[0] * 4000000] * 4000000`` holds a few megabytes of pointers but prints 10^13
  characters, and comparing, printing or serialising it costs that much. No list, string or
  output of a rendering may weigh more than the cap; the few operations that can amplify (``*``,
  ``+``, ``~``, ``%``, ``format``, ``join``, padding, indenting, ...) are checked before they run,
  every other filter and call is checked on its result (the checks before an operation are in
  :mod:`ssdlib.tokenizer.template_checks`), and lazy results (``map``, ``select``)
  are built here, item by item, under the same cap.
- **Python code between two checks is short.** Every loop iteration, call, filter, attribute
  lookup and operator checks the deadline; since no value weighs more than the cap, no single
  operation between two checks (a ``str()``, a comparison, a sort) runs for long.

Either bound raises :class:`TemplateLimit`.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Iterator, Mapping, Sized
from typing import Any

from jinja2 import nodes
from jinja2.exceptions import TemplateError
from jinja2.runtime import str_join
from jinja2.utils import Namespace
from jinja2.visitor import NodeTransformer

# What one item of a list, tuple or dict adds to the measure: its separator in ``str()`` and
# its slot. It also keeps the number of items (each a Python object that a sort or a comparison
# visits one by one) at a quarter of the cap.
ITEM_WEIGHT = 4


class TemplateLimit(TemplateError):
    """The template went past the time or size bound of one rendering."""


class Budget:
    """The bounds of the rendering in progress on this thread (:meth:`enter` makes it so)."""

    _current = threading.local()

    def __init__(self, seconds: float, max_chars: int):
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.max_chars = max_chars
        self._outer: Budget | None = None

    @classmethod
    def active(cls) -> "Budget | None":
        return getattr(cls._current, "budget", None)

    def __enter__(self) -> "Budget":
        self._outer = Budget.active()
        Budget._current.budget = self
        return self

    def __exit__(self, *exc: Any) -> None:
        Budget._current.budget = self._outer

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"rendering took longer than {self.seconds:g} s")

    def size(self, n: float, what: str = "a value") -> None:
        if n > self.max_chars:
            raise TemplateLimit(f"{what} would be longer than {self.max_chars} characters")


def tick() -> None:
    """Check the deadline of the rendering in progress (none: compile time, no check)."""
    budget = Budget.active()
    if budget is not None:
        budget.tick()


def size(n: float, what: str = "a value") -> None:
    """Refuse a string or list about to be ``n`` characters long, beyond the cap."""
    budget = Budget.active()
    if budget is not None:
        budget.size(n, what)


def length(value: Any) -> int:
    return len(value) if isinstance(value, (str, bytes, list, tuple, dict)) else 0


class _Measure:
    """Measures values for one check; a part reached twice is counted twice (``str()`` prints
    it twice) but walked once."""

    def __init__(self, limit: float):
        self.limit = limit
        self.memo: dict[int, tuple[int, int, int]] = {}  # id -> (weight, items, depth)

    def __call__(self, value: Any) -> tuple[int, int, int]:
        if isinstance(value, (str, bytes)):
            return len(value), 0, 0
        if isinstance(value, int):  # bool included; decimal digits <= bits / 3
            return value.bit_length() // 3 + 1, 0, 0
        if value is None or isinstance(value, (float, complex)):
            return 24, 0, 0
        if isinstance(value, range):
            return len(value) * (ITEM_WEIGHT + len(str(value.stop))), len(value), 1
        if isinstance(value, Namespace):
            value = value._Namespace__attrs  # jinja's own attribute (name-mangled)
        if isinstance(value, Mapping):
            children = (x for kv in value.items() for x in kv)
        elif isinstance(value, Sized) and not isinstance(value, Iterator) \
                and hasattr(value, "__iter__"):
            children = iter(value)  # list, tuple, set, dict views
        else:
            return 64, 0, 0  # an object (a macro, a loop, undefined): a short repr
        key = id(value)
        if key in self.memo:
            return self.memo[key]
        self.memo[key] = (0, 0, 0)  # a cycle (a namespace holding itself) adds nothing
        total, items, depth = 0, 0, 0
        for child in children:
            w, n, d = self(child)
            total += w + ITEM_WEIGHT
            items += n + 1
            depth = max(depth, d)
            if total > self.limit:
                raise TemplateLimit(f"a value would be longer than {int(self.limit)} characters")
        self.memo[key] = (total, items, depth + 1)
        return self.memo[key]


def shape(value: Any) -> tuple[int, int, int]:
    """(weight, items, nesting depth) of ``value``, items counted like the weight; raises
    :class:`TemplateLimit` once it is over the cap. Outside a rendering all are 0 (nothing is
    checked)."""
    budget = Budget.active()
    if budget is None:
        return 0, 0, 0
    return _Measure(budget.max_chars)(value)


def weight(value: Any) -> int:
    """About the length of ``str(value)``, shared parts counted each time (see the docstring)."""
    return shape(value)[0]


def check_weight(value: Any, what: str = "a value") -> Any:
    """``value``, once it is known to weigh no more than the cap."""
    size(weight(value), what)
    return value


def bounded_result(value: Any, what: str = "a result") -> Any:
    """A filter's or call's result, checked: a lazy result (``map``, ``select``) is built into a
    list here, one item at a time, so that the deadline and the cap apply while it grows."""
    if isinstance(value, Iterator):
        items, total = [], 0
        for item in value:
            tick()
            total += weight(item) + ITEM_WEIGHT
            size(total, what)
            items.append(item)
        return items
    if isinstance(value, (str, bytes, list, tuple, dict, Namespace)) or (
            isinstance(value, Sized) and not isinstance(value, range)):
        check_weight(value, what)
    return value


def bounded_filter(func: Any) -> Any:
    """``func`` as a filter that checks the deadline and bounds its result (jinja's
    ``pass_context`` / ``pass_environment`` markers are kept by ``functools.wraps``)."""

    @functools.wraps(func)
    def bounded(*args: Any, **kwargs: Any) -> Any:
        tick()
        return bounded_result(func(*args, **kwargs), "a filter's result")

    return bounded


def bounded_loop(iterable: Any):
    """Wraps every ``{% for %}`` iterable: the deadline is checked at each iteration."""
    for item in iterable:
        tick()
        yield item


def bounded_concat(first: Any, *rest: Any) -> str:
    """``a ~ b ~ ...``: the parts are measured before any of them is turned into a string."""
    parts = [first, *rest]
    size(sum(weight(p) for p in parts), "a joined string")
    return str_join(parts)


def bounded_join(pieces: Any) -> str:
    """The output of a macro, a ``{% set %}`` block or a ``{% filter %}`` block, joined."""
    pieces = list(pieces)
    size(sum(len(p) for p in pieces), "a block's output")
    return "".join(pieces)


def bounded_build(value: Any) -> Any:
    """A list, tuple or dict written in the template (``[x, x, x]``), checked once built."""
    return check_weight(value, "a list")


class BoundNodes(NodeTransformer):
    """Rewrites a parsed template so that loops, ``~`` and the lists, tuples and dicts it writes
    go through the bounded helpers above (filters named ``ssd_*``)."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Filter(node.iter, "ssd_bounded_loop", [], [], None, None,
                                 lineno=node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Filter:
        node = self.generic_visit(node)
        return nodes.Filter(node.nodes[0], "ssd_bounded_concat", list(node.nodes[1:]), [], None,
                            None, lineno=node.lineno)

    def _built(self, node: nodes.Expr) -> nodes.Node:
        node = self.generic_visit(node)
        if getattr(node, "ctx", "load") != "load":  # an assignment target: nothing is built
            return node
        return nodes.Filter(node, "ssd_bounded_build", [], [], None, None, lineno=node.lineno)

    visit_List = visit_Tuple = visit_Dict = _built
