"""Hostile chat templates are stopped with one clear error: rendering is bounded in time and in
the size of what it builds (issue 14, item 12). Each render runs in a forked child with a memory
cap and a deadline, so an unbounded renderer fails the test instead of hanging it or exhausting
the machine."""

import multiprocessing
import resource
import time

import pytest

from ssdlib.errors import SSDError
from ssdlib.tokenizer import chat_template
from ssdlib.tokenizer.chat_template import render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]
CHILD_EXTRA_MEMORY = 2 << 30  # address space a render may add to the forked test process


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _render_child(template: str, conn) -> None:
    limit = _vm_size() + CHILD_EXTRA_MEMORY
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        conn.send(("text", render_chat_template(template, MESSAGES)[:200]))
    except SSDError as e:
        conn.send(("ssd_error", str(e)))
    except BaseException as e:  # reported to the test as a failure of the bound
        conn.send(("other", f"{type(e).__name__}: {e}"[:500]))


def render_within(template: str, seconds: float):
    """(kind, text) of rendering ``template`` in a child; fails if it runs past ``seconds``."""
    parent, child = multiprocessing.get_context("fork").Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_render_child,
                                                       args=(template, child))
    t0 = time.monotonic()
    proc.start()
    try:
        assert parent.poll(seconds), f"rendering still running after {seconds} s"
        return parent.recv(), time.monotonic() - t0
    finally:
        proc.kill()
        proc.join()


SLOW = {
    "nested range loops": "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}"
                          "{% endfor %}",
    "nested loops over a string": "{% set s = 'x' * 3000 %}{% for a in s %}{% for b in s %}"
                                  "{% for c in s %}{% endfor %}{% endfor %}{% endfor %}",
    "recursive loop": "{% for m in [[1, 2]] * 99999 recursive %}{{ loop([1, 2]) if m is "
                      "iterable else '' }}{% endfor %}",
}


@pytest.mark.parametrize("template", list(SLOW.values()), ids=list(SLOW))
def test_rendering_time_is_bounded(template, monkeypatch):
    monkeypatch.setattr(chat_template, "MAX_RENDER_S", 0.3)
    (kind, text), took = render_within(template, 10)
    assert kind == "ssd_error", text
    assert "longer than 0.3 s" in text or "RecursionError" in text, text
    assert took < 6  # generous: the machine may be busy


HUGE = {
    "string repetition": "{{ 'a' * 10**10 }}",
    "list repetition": "{{ ([1] * 10**10)|length }}",
    "power": "{{ 10 ** (10 ** 10) }}",
    "center filter": "{{ 'a'|center(10**10) }}",
    "str method": "{{ 'a'.ljust(10**10) }}",
    "printf width": "{{ '%10000000000s' % 'a' }}",
    "format width": "{{ '{:>10000000000}'.format('a') }}",
    "nested format width": "{{ '{:>{w}}'.format('a', w=10**10) }}",
    "format filter": "{{ '%10000000000s'|format('a') }}",
    "replace": "{{ ('a' * 4000).replace('', 'b' * 4000) }}",
    "join": "{{ ('x' * 100000).join(['a'] * 99999) }}",
    "join filter": "{{ range(99999)|join('x' * 100000) }}",
    "indent filter": "{{ ('a\\n' * 1000)|indent(10**7) }}",
    "tojson indent": "{{ messages|tojson(indent=10**10) }}",
    "batch filter": "{{ [1]|batch(10**10, 'x')|list }}",
    "doubling with ~": "{% set s = 'ab' %}" + "{% set s = s ~ s %}" * 40 + "{{ s|length }}",
    "doubling in a namespace": "{% set ns = namespace(s='ab') %}{% for i in range(40) %}"
                               "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
    "output size": "{% for i in range(99999) %}{{ 'x' * 1000 }}{% endfor %}",
    "recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
}


@pytest.mark.parametrize("template", list(HUGE.values()), ids=list(HUGE))
def test_rendering_size_is_bounded(template):
    (kind, text), took = render_within(template, 10)
    assert kind == "ssd_error" and "chat template" in text, text
    assert took < 6


def test_ordinary_templates_render_as_before():
    t = ("{% for m in messages %}<{{ m.role }}>{{ m['content'] ~ '!' }}{% endfor %}"
         "{{ '%5s|%-3d' % ('a', 2) }}{{ '{:>4}'.format('b') }}{{ 'x'|center(5) }}"
         "{{ '{}'.format(1700000000) }}{{ [1, 2, 3]|join(', ') }}{{ 'ab'|replace('a', 'c') }}"
         "{{ messages|tojson }}{% for i in range(3) %}{{ loop.index }}"
         "{% if loop.last %}.{% endif %}{% endfor %}")
    assert render_chat_template(t, MESSAGES) == (
        '<user>hi!    a|2     b  x  1700000000'
        '1, 2, 3cb[{"role": "user", "content": "hi"}]123.')
