"""Does confining the speculator's build to a share of the SMs keep it from slowing the verify?

Two CUDA graphs (random weights, bf16): a SmolLM2-shaped verify of K + 1 = 4 positions and a
build of the default draft's shape (4 dependent steps over F branch rows). Each is timed alone,
then both at once: the build on a low-priority stream (what the stream placement does), and the
build on the stream of a CUDA green context holding N of the GPU's SMs
(``torch.cuda.green_contexts``). The verify's own time is read from CUDA events on its stream.

Needs ``floor_probe.py`` (the plain-torch decode step) in ``--probe-dir``:

    python3 dev/green_probe.py --probe-dir .stage [--sms 8,16,32,66]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch


def graph_of(fp, layers, d, ffn, hq, hkv, hd, vocab, b, s, reps, L=1024, capture_stream=None):
    W, emb = fp.make(layers, d, ffn, hq, hkv, hd, vocab, L, b)
    inv = 1.0 / (1e5 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    f = torch.outer(torch.arange(L, device="cuda").float(), inv)
    cos, sin = f.cos().to(fp.dt)[:, :hd // 2], f.sin().to(fp.dt)[:, :hd // 2]
    ids = torch.randint(0, vocab, (b, s), device="cuda")
    pos = (torch.arange(s, device="cuda") + 300).expand(b, s).contiguous()
    side = capture_stream or torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fp.step(W, emb, ids, pos, cos, sin, hq, hkv, hd, L)
    torch.cuda.current_stream().wait_stream(side)
    keep = (W, emb, cos, sin, ids, pos)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=capture_stream):
        for _ in range(reps):
            out = fp.step(W, emb, ids, pos, cos, sin, hq, hkv, hd, L)
            ids = out.view(b, 1).expand(b, s).contiguous()
    return g, keep


def timed(launches, verify_stream, n=200):
    """Mean ms of ``launches()`` (wall, synchronised) and of the verify's own span on its stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(10):
        launches(None, None)
    torch.cuda.synchronize()
    wall = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    verify_ms = 0.0
    wall[0].record()
    for _ in range(n):
        launches(start, end)
        end.synchronize()
        verify_ms += start.elapsed_time(end)
    torch.cuda.synchronize()
    wall[1].record()
    torch.cuda.synchronize()
    return wall[0].elapsed_time(wall[1]) / n, verify_ms / n


def alone_on(stream, work):
    """Launches for :func:`timed`: ``work()`` alone on ``stream``, between the timing events."""
    def launches(start, end):
        main = torch.cuda.current_stream()
        stream.wait_stream(main)
        with torch.cuda.stream(stream):
            if start is not None:
                start.record()
            work()
            if end is not None:
                end.record()
        main.wait_stream(stream)
    return launches


def run_case(fp, name, verify_shape, build_shape, sms_list):
    gv, kv = graph_of(fp, *verify_shape)
    gb, kb = graph_of(fp, *build_shape)
    nonlocal_graph = [gb]  # the build graph the launches replay
    low, high = torch.cuda.Stream.priority_range()
    sv = torch.cuda.Stream(priority=high)
    sb = torch.cuda.Stream(priority=low)

    def make(build_stream):
        def launches(start, end):
            main = torch.cuda.current_stream()
            sv.wait_stream(main)
            if build_stream is not None:
                build_stream.wait_stream(main)
            with torch.cuda.stream(sv):
                if start is not None:
                    start.record()
                gv.replay()
                if end is not None:
                    end.record()
            if build_stream is not None:
                with torch.cuda.stream(build_stream):
                    nonlocal_graph[0].replay()
                main.wait_stream(build_stream)
            main.wait_stream(sv)
        return launches

    def build_alone(stream):
        return alone_on(stream, lambda: nonlocal_graph[0].replay())

    _, v_alone = timed(make(None), sv)
    _, b_alone = timed(build_alone(sb), sb)
    print(f"== {name}: verify alone {v_alone:.3f} ms, build alone {b_alone:.3f} ms "
          f"(sequential {v_alone + b_alone:.3f})", flush=True)
    wall, v = timed(make(sb), sv)
    print(f"  low-priority stream        : both {wall:.3f} ms, verify {v:.3f} "
          f"({v / v_alone:.2f}x alone)", flush=True)
    from torch.cuda import green_contexts
    if not green_contexts.SUPPORTED:
        print("  green contexts: not supported by this torch build", flush=True)
        return
    total = torch.cuda.get_device_properties(0).multi_processor_count
    for sms in sms_list:
        if sms >= total:
            continue
        try:
            ctx = green_contexts.GreenContext.create(num_sms=sms, device_id=0)
            gs = ctx.Stream()
        except Exception as exc:  # noqa: BLE001 - a lab probe reports and goes on
            print(f"  green context of {sms} SMs: {type(exc).__name__}: {exc}", flush=True)
            continue
        _, b_green = timed(build_alone(gs), gs)
        W, emb, cos, sin, ids, pos = kb
        hq, hkv, hd = build_shape[3:6]

        def eager_on(stream):
            return alone_on(stream, lambda: fp.step(W, emb, ids, pos, cos, sin, hq, hkv, hd, 1024))
        try:
            _, e_full = timed(eager_on(sb), sb, n=50)
            _, e_green = timed(eager_on(gs), gs, n=50)
            print(f"  one eager build step: full GPU {e_full:.3f} ms, green context of {sms} SMs "
                  f"{e_green:.3f} ms", flush=True)
        except Exception as exc:  # noqa: BLE001 - a lab probe reports and goes on
            print(f"  eager on the green stream: {type(exc).__name__}: {exc}", flush=True)
        wall, v = timed(make(gs), sv)
        print(f"  green context {sms:3d}/{total} SMs, graph captured outside: build alone "
              f"{b_green:.3f} ms; both {wall:.3f} ms, verify {v:.3f} ({v / v_alone:.2f}x alone)",
              flush=True)
        for how in ("on its stream", "on its stream, context set"):
            try:
                if how.endswith("set"):
                    ctx.set_context()
                try:
                    gb_in, kb_in = graph_of(fp, *build_shape, capture_stream=gs)
                finally:
                    if how.endswith("set"):
                        ctx.pop_context()
            except Exception as exc:  # noqa: BLE001 - a lab probe reports and goes on
                print(f"    captured {how}: {type(exc).__name__}: {exc}", flush=True)
                continue
            nonlocal_graph[0] = gb_in
            _, b_in = timed(build_alone(gs), gs)
            wall, v = timed(make(gs), sv)
            nonlocal_graph[0] = gb
            print(f"    captured {how}: build alone {b_in:.3f} ms; both {wall:.3f} ms, verify "
                  f"{v:.3f} ({v / v_alone:.2f}x alone)", flush=True)
            del kb_in
    del kv, kb


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe-dir", default=".stage")
    ap.add_argument("--sms", default="8,32,66")
    args = ap.parse_args()
    sys.path.insert(0, os.path.abspath(args.probe_dir))
    import floor_probe as fp  # noqa: E402 - the reference step lives beside the probe
    sms = [int(x) for x in args.sms.split(",")]
    smol = (30, 576, 1536, 9, 3, 64, 49152)
    draft = (6, 256, 1024, 8, 4, 32, 49152)
    print(torch.cuda.get_device_name(0), torch.__version__, flush=True)
    run_case(fp, "b = 1, build of 16 rows", smol + (1, 4, 1), draft + (16, 1, 4), sms)
    run_case(fp, "b = 8, build of 64 rows", smol + (8, 4, 1), draft + (64, 1, 4), sms)


if __name__ == "__main__":
    main()
