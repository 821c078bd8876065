"""Prints the GPU timeline of a JAX profiler trace: every GPU event with the idle time before
it, the period between launches of one kernel, and the host's launch / execute events.

    python3 tools/trace_timeline.py TRACE.trace.json.gz [KERNEL_NAME]

Where the time between a kernel's own duration and the untraced time per call goes (launch
gaps, host work before the first kernel). Times in us from the first GPU event.
"""

from __future__ import annotations

import sys

from experiments.measure import trace as trace_lib

HOST_EVENTS = ("cuGraphLaunch", "call", "Execute", "copy", "while")


def main(path: str, kernel: str = "body_mosaic_gpu_kernel") -> None:
    events = trace_lib.load_trace(path)["traceEvents"]
    procs = {
        e["pid"]: e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    done = [e for e in events if e.get("ph") == "X"]
    gpu = sorted((e for e in done if procs.get(e["pid"], "").startswith("/device")),
                 key=lambda e: e["ts"])  # fmt: skip
    host = sorted((e for e in done if procs.get(e["pid"], "").startswith("/host")),
                  key=lambda e: e["ts"])  # fmt: skip
    if not gpu:
        raise SystemExit(f"{path}: no GPU events")
    t0, end = gpu[0]["ts"], None
    print("GPU events: start, duration, idle before, name")
    for e in gpu:
        idle = "" if end is None else f"{e['ts'] - end:8.2f}"
        print(f"{e['ts'] - t0:9.2f} {e['dur']:8.2f} {idle:>8} {e['name']}")
        end = e["ts"] + e["dur"]
    launches = [e for e in gpu if e["name"] == kernel]
    if len(launches) > 1:
        period = (launches[-1]["ts"] - launches[0]["ts"]) / (len(launches) - 1)
        print(f"{kernel}: {len(launches)} launches, {period:.2f} us from one to the next")
    print(f"GPU span {end - t0:.1f} us")
    print("host events: start, duration, name")
    for e in host:
        if any(key in e["name"] for key in HOST_EVENTS):
            print(f"{e['ts'] - t0:9.2f} {e['dur']:8.2f} {e['name']}")


if __name__ == "__main__":
    main(*sys.argv[1:])
