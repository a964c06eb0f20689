"""Server start-up and shutdown, measured from outside as a user sees them.

    python dev/startup_probe.py --json out.json --log serve.log -- --mode sd --max-batch 8

Starts ``python -m ssdlib.serve`` with the arguments after ``--``, then measures:
- ``ready_s``: from the process start to the first ``/health`` 200;
- the first request after ready, then ``--n-sequential`` requests one after another (latency
  p50/p95 and the overall completion tokens a second);
- SIGTERM with ``--n-streams`` streaming requests in flight: how each stream ended, the exit
  status, the seconds to exit, child processes left behind, "leaked semaphore" in the log.
Prompts: tools/distill/heldout_chat.jsonl (cycled). Standard library only.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def prompts() -> list[list[dict]]:
    with open(os.path.join(ROOT, "tools", "distill", "heldout_chat.jsonl")) as f:
        return [json.loads(line)["messages"] for line in f if line.strip()]


def post(port: int, body: dict, timeout: float = 120.0) -> tuple[int, dict, float]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    data = json.loads(resp.read() or b"{}")
    conn.close()
    return resp.status, data, time.perf_counter() - t0


def stream(port: int, body: dict, result: dict) -> None:
    """One streaming request; records how it ended."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        conn.request("POST", "/v1/chat/completions", json.dumps({**body, "stream": True}),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        result["status"] = resp.status
        chunks, done, finish = 0, False, None
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                done = True
                break
            chunk = json.loads(payload)
            chunks += 1
            for choice in chunk.get("choices", []):
                finish = choice.get("finish_reason") or finish
        result.update(chunks=chunks, done=done, finish_reason=finish)
    except Exception as e:  # noqa: BLE001 - the probe records whatever the client saw
        result["error"] = f"{type(e).__name__}: {e}"


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True,
                         text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8019)
    ap.add_argument("--json", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--n-sequential", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--n-streams", type=int, default=4)
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--no-sigterm", action="store_true", help="stop with SIGTERM without streams")
    args, serve_args = ap.parse_known_args()
    serve_args = [a for a in serve_args if a != "--"]
    msgs = prompts()
    report: dict = {"serve_args": serve_args}
    log = open(args.log, "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ssdlib.serve", "--port", str(args.port),
                             *serve_args], stdout=log, stderr=subprocess.STDOUT)
    ready = None
    while time.perf_counter() - t0 < args.ready_timeout and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", args.port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                ready = time.perf_counter() - t0
                break
        except OSError:
            pass
        time.sleep(0.1)
    report["ready_s"] = ready
    if ready is None:
        proc.kill()
        report["error"] = f"not ready (exit {proc.poll()})"
        json.dump(report, open(args.json, "w"), indent=1)
        return 1
    body = {"max_tokens": args.max_tokens, "temperature": 0}
    status, data, first = post(args.port, {**body, "messages": msgs[0]})
    report["first_request"] = {"status": status, "s": first,
                               "tokens": data.get("usage", {}).get("completion_tokens")}
    lat, toks, again = [], 0, None
    t1 = time.perf_counter()
    for i in range(args.n_sequential):
        j = (i + 1) % len(msgs)
        status, data, s = post(args.port, {**body, "messages": msgs[j]})
        lat.append(s)
        if j == 0:  # the first request's prompt again, warm: the fair comparison
            again = s
        toks += data.get("usage", {}).get("completion_tokens", 0) if status == 200 else 0
    wall = time.perf_counter() - t1
    report["first_prompt_again_s"] = again
    report["first_over_again"] = first / again if again else None
    if lat:
        lat.sort()
        report["sequential"] = {
            "n": len(lat), "wall_s": wall, "completion_tokens": toks, "tok_s": toks / wall,
            "p50_s": statistics.median(lat), "p95_s": lat[int(0.95 * (len(lat) - 1))]}
        report["first_over_p50"] = first / statistics.median(lat)
    kids = children(proc.pid)
    results = [{} for _ in range(0 if args.no_sigterm else args.n_streams)]
    threads = [threading.Thread(target=stream, args=(args.port, {
        "max_tokens": 512, "temperature": 0, "messages": msgs[i % len(msgs)]}, r))
        for i, r in enumerate(results)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    t2 = time.perf_counter()
    proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "killed after 90 s"
    exit_s = time.perf_counter() - t2
    for t in threads:
        t.join(timeout=30)
    log.close()
    text = open(args.log).read()
    report["sigterm"] = {"exit": code, "exit_s": exit_s, "streams": results,
                         "children_before": kids,
                         "children_left": [k for k in kids if alive(k)],
                         "leaked_semaphore": "leaked semaphore" in text,
                         "listening_line": "listening on" in text}
    json.dump(report, open(args.json, "w"), indent=1)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
