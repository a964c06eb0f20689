"""ssdlib.quick_exit: the exit handlers run, buffered output reaches its pipe and the code is the
process's; with another thread still running, or SSDLIB_QUICK_EXIT=0, the ordinary exit (the
thread finishes first). Each case runs in a fresh interpreter."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time
    from ssdlib.quick_exit import quick_exit
    marker = sys.argv[1]
    atexit.register(lambda: open(marker, "a").write("atexit;"))
    if sys.argv[2] == "thread":
        def late():
            time.sleep(0.3)
            open(marker, "a").write("thread;")
        threading.Thread(target=late).start()
    sys.stdout.write("x" * 100000)  # no newline: still in the buffer
    sys.stderr.write("partial")
    quick_exit(int(sys.argv[3]))
""")


def _run(tmp_path, mode, code, **env):
    marker = tmp_path / "marker"
    environ = {k: v for k, v in os.environ.items() if k != "SSDLIB_QUICK_EXIT"}
    environ.update(PYTHONPATH=ROOT, **env)
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(marker), mode, str(code)],
                         capture_output=True, text=True, env=environ)
    return out, marker.read_text() if marker.exists() else ""


def test_exit_handlers_run_output_is_flushed_and_the_code_kept(tmp_path):
    out, marks = _run(tmp_path, "plain", 3)
    assert out.returncode == 3
    assert out.stdout == "x" * 100000 and out.stderr == "partial"
    assert marks == "atexit;"


def test_a_running_thread_gets_the_ordinary_exit(tmp_path):
    out, marks = _run(tmp_path, "thread", 0)
    assert out.returncode == 0 and out.stdout == "x" * 100000
    assert marks.startswith("thread;atexit;")


def test_switched_off_by_the_environment(tmp_path):
    out, marks = _run(tmp_path, "plain", 2, SSDLIB_QUICK_EXIT="0")
    assert out.returncode == 2 and out.stdout == "x" * 100000
    assert marks == "atexit;"
