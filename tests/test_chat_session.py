"""Chat sessions: a conversation that outgrows --max-len drops its oldest turns, a message too
long on its own is refused, and the session goes on; Ctrl-C stops the answer, a second one at the
prompt exits. A Generator stays usable after an interrupted call."""

import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from ssdlib import Generator, SamplingParams
from tests.tiny_chat import make_tiny_chat_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _terminal_sigint() -> None:
    """In the child: SIGINT as a terminal's foreground job has it. A background job of a
    non-interactive shell (e.g. a test run started with ``&``) inherits SIGINT ignored, and a
    Python started with SIGINT ignored never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("chat") / "m"))


def test_a_long_conversation_drops_old_turns_and_goes_on(chat_model, monkeypatch, capsys):
    from ssdlib import chat

    turns = ["Tell me about the sea.", "And the sky?", "x" * 100, "What about rivers?",
             "Thanks, bye."]
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t + "\n" for t in turns)))
    rc = chat.main(["--target", chat_model, "--max-len", "64", "--max-new-tokens", "8",
                    "--ignore-eos", "--metrics"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    answers = [l for l in out.splitlines() if l.startswith("[") and "tok/s" in l]
    assert len(answers) == 4, out  # every message but the one too long on its own
    assert "dropped the 1 oldest exchange(s)" in err, err
    refused = [l for l in err.splitlines() if l.startswith("ssdlib error")]
    assert len(refused) == 1 and "it was not sent" in refused[0], err


def test_fit_conversation_keeps_the_system_prompt(chat_model):
    from ssdlib.chat import fit_conversation

    p = SamplingParams(max_new_tokens=8)
    with Generator(target=chat_model, max_len=64, start=False) as g:
        system = {"role": "system", "content": "Be brief."}
        history = [{"role": r, "content": "word " * 3} for r in ("user", "assistant") * 3]
        msgs, dropped = fit_conversation(g, [system, *history, {"role": "user", "content": "Hi"}],
                                         p)
        assert msgs[0] == system and msgs[-1]["content"] == "Hi" and dropped >= 1
        assert len(g.encode({"messages": msgs})) + 8 < 64
        assert [m["role"] for m in msgs[1:]] == ["user", "assistant"] * ((len(msgs) - 2) // 2) \
            + ["user"]


def _read_into(stream, buf: list) -> None:
    for ch in iter(lambda: stream.read(1), ""):
        buf.append(ch)


def _wait_for(buf: list, needle: str, start: int, timeout: float) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        text = "".join(buf)
        i = text.find(needle, start)
        if i >= 0:
            return i + len(needle)
        time.sleep(0.02)
    raise AssertionError(f"{needle!r} not seen after position {start}: {''.join(buf)[-300:]!r}")


def test_ctrl_c_stops_the_answer_and_then_exits(chat_model):
    proc = subprocess.Popen([sys.executable, "-m", "ssdlib.chat", "--target", chat_model,
                             "--max-len", "4000", "--max-new-tokens", "3000", "--ignore-eos"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_terminal_sigint)
    out: list = []
    threading.Thread(target=_read_into, args=(proc.stdout, out), daemon=True).start()
    try:
        pos = 0
        for message in ("Hello there", "Again"):
            proc.stdin.write(message + "\n")
            proc.stdin.flush()
            deadline = time.time() + 60
            while len("".join(out)) < pos + 20 and time.time() < deadline:
                time.sleep(0.02)  # the answer is streaming
            proc.send_signal(signal.SIGINT)
            pos = _wait_for(out, "[interrupted]", pos, 5)
        assert proc.poll() is None  # both answers interrupted, the session still going
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)  # at the prompt: exit
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 130, err
        assert "Traceback" not in err, err
        assert [l for l in err.splitlines() if l.startswith("ssdlib")] == \
            ["ssdlib: interrupted"], err
    finally:
        if proc.poll() is None:
            proc.kill()


def test_generator_is_usable_after_an_interrupted_spawned_call(chat_model, tmp_path):
    """Ctrl-C while a spawned SSD job streams (the KeyboardInterrupt is raised where the signal
    would land: in the main process, waiting for the leader): generate raises it, and the next
    call's output is its own (the interrupted call's output is dropped)."""
    from tests.tiny import make_noisy_draft

    draft = make_noisy_draft(chat_model, str(tmp_path / "draft"), 0.03)
    p = SamplingParams(max_new_tokens=60, ignore_eos=True)

    def ctrl_c(_i, _delta):
        raise KeyboardInterrupt

    with Generator(target=chat_model, max_len=128) as g:
        ref = g.generate(["Hi"], p)[0].token_ids
    with Generator(target=chat_model, draft=draft, mode="ssd", max_len=128, max_batch=2,
                   speculator_placement="rank") as g:
        with pytest.raises(KeyboardInterrupt):
            g.generate(["Hello", "Tell me"], p, on_text=ctrl_c)
        assert g.generate(["Hi"], p)[0].token_ids == ref


def test_an_interrupted_spawned_call_stops_on_the_ranks(chat_model, tmp_path):
    """Ctrl-C during a long spawned SSD call cancels its sequences on the leader: the next call
    does not wait for the interrupted one to run to its end."""
    import time

    from tests.tiny import make_noisy_draft

    draft = make_noisy_draft(chat_model, str(tmp_path / "draft"), 0.03)
    long = SamplingParams(max_new_tokens=1900, ignore_eos=True)
    short = SamplingParams(max_new_tokens=4, ignore_eos=True)
    seen = []

    def ctrl_c(_i, delta):
        seen.append(delta)
        if len(seen) == 3:
            raise KeyboardInterrupt

    with Generator(target=chat_model, draft=draft, mode="ssd", max_len=2048, max_batch=2,
                   speculator_placement="rank") as g:
        t0 = time.perf_counter()
        g.generate(["Hi"], SamplingParams(max_new_tokens=200, ignore_eos=True))
        per_token = (time.perf_counter() - t0) / 200
        with pytest.raises(KeyboardInterrupt):
            g.generate(["Hello", "Tell me"], long, on_text=ctrl_c)
        t0 = time.perf_counter()
        out = g.generate(["Hi"], short)[0]
        waited = time.perf_counter() - t0
    assert len(out.token_ids) == 4
    # running the interrupted call to its end would take ~1900 tokens' time
    assert waited < 300 * per_token + 2.0, (waited, per_token)


@pytest.fixture
def sigint_raises():
    """SIGINT raises KeyboardInterrupt in this process (a test run started in the background
    inherits it ignored)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


# where a Ctrl-C lands in an interrupted turn, each raised as a real SIGINT at that instant
CTRL_C_POINTS = ("in chat, before the request is made", "just before the request is queued",
                 "just after the request is queued", "while the answer streams",
                 "just after the answer came")


def test_ctrl_c_anywhere_after_enter_keeps_an_ssd_session_in_step(chat_model, tmp_path,
                                                                  monkeypatch, capsys,
                                                                  sigint_raises):
    """An SSD chat (the speculator on a rank of its own: spawned ranks) whose turns alternate:
    one interrupted by a Ctrl-C at one of CTRL_C_POINTS, then one that runs. Every answer that
    completes is the one the target alone gives for its own conversation (never the interrupted
    one's), and /exit exits 0."""
    from ssdlib import chat
    from ssdlib.generator import Generator as Gen
    from tests.tiny import make_noisy_draft

    draft = make_noisy_draft(chat_model, str(tmp_path / "draft"), 0.03)
    turns = [f"Question {i}?" for i in range(2 * len(CTRL_C_POINTS))]
    plan = {2 * i: point for i, point in enumerate(CTRL_C_POINTS)}  # turn -> where Ctrl-C lands
    state = {"turn": -1, "streamed": False, "last_message": time.time()}
    completed = []  # (prompt, params, token ids) of each generate call that returned

    def at(point):
        return plan.get(state["turn"]) == point

    real_fit = chat.fit_conversation

    def fit(*a, **kw):
        state["turn"] += 1
        state["streamed"] = False
        out = real_fit(*a, **kw)
        if at(CTRL_C_POINTS[0]):
            signal.raise_signal(signal.SIGINT)
        return out

    real_start = Gen.start

    def start(self, *args, **kwargs):
        started = self._started
        real_start(self, *args, **kwargs)
        if started:  # generate calls start too: spy once
            return
        put, get = self._inbox.put, self._outbox.get

        def put_spy(msg, *a, **kw):
            if msg[0] == "generate" and at(CTRL_C_POINTS[1]):
                signal.raise_signal(signal.SIGINT)
            put(msg, *a, **kw)
            if msg[0] == "generate" and at(CTRL_C_POINTS[2]):
                signal.raise_signal(signal.SIGINT)

        def get_spy(*a, **kw):
            # a session out of step waits for a result that never comes: fail instead of hang
            assert time.time() - state["last_message"] < 60, "no message from the leader"
            msg = get(*a, **kw)
            state["last_message"] = time.time()
            if msg[0] == "event" and not state["streamed"] and at(CTRL_C_POINTS[3]):
                state["streamed"] = True
                signal.raise_signal(signal.SIGINT)
            if msg[0] == "result" and at(CTRL_C_POINTS[4]):
                signal.raise_signal(signal.SIGINT)
            return msg

        self._inbox.put, self._outbox.get = put_spy, get_spy

    real_generate = Gen.generate

    def generate(self, prompts, params=None, *a, **kw):
        outputs = real_generate(self, prompts, params, *a, **kw)
        completed.append((prompts[0], params, outputs[0].token_ids))
        return outputs

    monkeypatch.setattr(chat, "fit_conversation", fit)
    monkeypatch.setattr(Gen, "start", start)
    monkeypatch.setattr(Gen, "generate", generate)
    monkeypatch.setattr(sys, "stdin", io.StringIO("".join(t + "\n" for t in turns) + "/exit\n"))
    rc = chat.main(["--target", chat_model, "--draft", draft, "--mode", "ssd",
                    "--speculator-placement", "rank", "--max-len", "256", "--max-new-tokens",
                    "12", "--ignore-eos"])
    out, err = capsys.readouterr()
    monkeypatch.undo()
    assert rc == 0, err
    assert out.count("[interrupted]") == len(CTRL_C_POINTS), out
    assert len(completed) == len(turns) - len(CTRL_C_POINTS), out
    with Generator(target=chat_model, max_len=256) as ref:
        for i, (prompt, params, ids) in enumerate(completed):
            assert ids == ref.generate([prompt], params)[0].token_ids, \
                f"answer {i} (after the Ctrl-C {CTRL_C_POINTS[i]!r}) is not its own"
