"""Hostile chat templates are stopped with one clear error: rendering is bounded in time and in
the size of what it builds. Each render runs in a forked child with a memory
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
    "summing lists": "{{ ([[0]] * 400000)|sum(start=[])|length }}",
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

# Values that are small to hold but huge to print, compare or copy: a part shared many times
# counts every time it occurs.
SHARED = {
    "repeating one inner list": "{{ [[0] * 4000000] * 4000000 }}",
    "comparing shared lists": "{% set a = [0] * 1000000 %}{% set b = [0] * 1000000 %}"
                              "{{ [a] * 1000 == [b] * 1000 }}",
    "nested list literals": "{% set a = [0] * 1000 %}" + "{% set a = [a, a] %}" * 40
                            + "{{ a }}",
    "a dict of one long value": "{{ {}.fromkeys(range(99999), 'x' * 100000) }}",
    "batch padding": "{{ [0]|batch(1000000, 'x' * 1000000)|list }}",
    "mapped padding": "{{ ([0] * 1000)|map('center', 4000000)|list|length }}",
    "mapped padding joined": "{{ ([0] * 1000)|map('center', 4000000)|join|length }}",
    "one argument per field": "{{ ('%(a)s' * 1000) % {'a': 'x' * 1000000} }}",
    "expanded tabs": "{{ ('\t' * 1000000).expandtabs(1000000)|length }}",
    "macro output doubling": "{% macro m0() %}" + "x" * 1000 + "{% endmacro %}" + "".join(
        f"{{% macro m{i + 1}() %}}{{{{ m{i}() }}}}{{{{ m{i}() }}}}{{% endmacro %}}"
        for i in range(30)) + "{{ m30()|length }}",
    "block output doubling": "{% set s = 'x' * 1000000 %}"
                             + "{% set s %}{{ s }}{{ s }}{% endset %}" * 30 + "{{ s|length }}",
    "constant folded at compile time": "{{ 'x'|center(100000000000) }}",
}


@pytest.mark.parametrize("template", list(HUGE.values()) + list(SHARED.values()),
                         ids=list(HUGE) + list(SHARED))
def test_rendering_size_is_bounded(template):
    (kind, text), took = render_within(template, 10)
    assert kind == "ssd_error" and "chat template" in text, text
    # the bound stopped it, not the memory cap of the test process
    assert "MemoryError" not in text, text
    assert took < 6


def test_a_long_conversation_is_within_the_bounds():
    messages = [{"role": ("user", "assistant")[i % 2], "content": f"{i} " + "word " * 2000}
                for i in range(200)]
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content|trim }}"
                "<|im_end|>\n{% endfor %}{{ messages|tojson(indent=2)|length }}")
    out = render_chat_template(template, messages)
    assert out.startswith("<|im_start|>user\n0 word word") and "199 word" in out


def test_ordinary_templates_render_as_before():
    t = ("{% for m in messages %}<{{ m.role }}>{{ m['content'] ~ '!' }}{% endfor %}"
         "{{ '%5s|%-3d' % ('a', 2) }}{{ '{:>4}'.format('b') }}{{ 'x'|center(5) }}"
         "{{ '{}'.format(1700000000) }}{{ [1, 2, 3]|join(', ') }}{{ 'ab'|replace('a', 'c') }}"
         "{{ messages|tojson }}{% for i in range(3) %}{{ loop.index }}"
         "{% if loop.last %}.{% endif %}{% endfor %}")
    assert render_chat_template(t, MESSAGES) == (
        '<user>hi!    a|2     b  x  1700000000'
        '1, 2, 3cb[{"role": "user", "content": "hi"}]123.')
