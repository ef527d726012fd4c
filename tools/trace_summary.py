#!/usr/bin/env python3
"""trace_summary.py TRACE.json... : what a kiln timeline trace (kiln_trace_end, KILN_TRACE,
profile_step --trace) says of its steps, as text, to set beside other timings.

For each trace: every step's device span (first device record to last), the device time its
records cover (busy) and their count; the median span; and the kernels of all the steps by
their mean time per step (kiln's names, launches per step, mean and min time per launch), the
figures to compare with `ncu --graph-profiling node` (gpu__time_duration) or CUDA-event timings
of the same step. --top N sets how many kernels (15), --csv writes the kernel table as CSV.
Only the standard library.
"""
import argparse
import csv
import json
import statistics
import sys


def device(e):
    return e.get("ph") == "X" and e.get("cat") in ("kernel", "memcpy", "memset")


def device_steps(path):
    """A trace's otherData and its device records by step ({step: [events]})."""
    with open(path) as f:
        doc = json.load(f)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    other = doc.get("otherData", {}) if isinstance(doc, dict) else {}
    steps = {}
    for e in events:
        if not device(e):
            continue
        s = e.get("args", {}).get("step", -1)
        steps.setdefault(s, []).append(e)
    return other, steps


def summary(path, top, out_csv):
    other, steps = device_steps(path)
    kept = sorted(s for s in steps if s >= 0) or sorted(steps)
    print(f"{path}: mode {other.get('mode', '?')}, device {other.get('device', '?')}, "
          f"{len(kept)} steps, {other.get('unattributed', 0)} unattributed, "
          f"{other.get('dropped_records', 0)} dropped")
    spans = []
    per_name = {}
    for s in kept:
        evs = sorted(steps[s], key=lambda e: e["ts"])
        t0 = evs[0]["ts"]
        t1 = max(e["ts"] + e["dur"] for e in evs)
        busy, cover = 0.0, t0
        for e in evs:
            start = max(e["ts"], cover)
            end = e["ts"] + e["dur"]
            if end > start:
                busy += end - start
            cover = max(cover, end)
        spans.append(t1 - t0)
        print(f"  step {s}: span {t1 - t0:.1f} us, busy {busy:.1f} us "
              f"({100 * busy / (t1 - t0) if t1 > t0 else 0:.1f}%), {len(evs)} records")
        for e in evs:
            if e["cat"] != "kernel":
                continue
            args = e.get("args", {})
            row = per_name.setdefault(e["name"], {"kind": args.get("kind", ""), "times": [],
                                                  "launches": set()})
            row["times"].append(e["dur"])
            # a launch's kernels share its launch id and group (a memset may come first)
            row["launches"].add((s, args.get("launch_id"), args.get("group"),
                                 None if "group" in args else e["ts"]))
    if not spans:
        return
    print(f"  median span {statistics.median(spans):.1f} us over {len(spans)} steps")
    n = len(kept)
    rows = sorted(per_name.items(), key=lambda kv: -sum(kv[1]["times"]))
    print(f"  {'kernel':60s} {'kind':12s} {'per step':>8s} {'us/step':>9s} {'us/launch':>9s} "
          f"{'min us':>8s}")
    for name, r in rows[:top]:
        launches = len(r["launches"])
        print(f"  {name[:60]:60s} {r['kind'][:12]:12s} {launches / n:8.1f} "
              f"{sum(r['times']) / n:9.1f} {sum(r['times']) / launches:9.2f} "
              f"{min(r['times']):8.2f}")
    if out_csv:
        w = csv.writer(out_csv)
        for name, r in rows:
            launches = len(r["launches"])
            w.writerow([path, name, r["kind"], launches / n, sum(r["times"]) / n,
                        sum(r["times"]) / launches, min(r["times"])])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--csv", help="write every kernel's row to this CSV file")
    a = ap.parse_args()
    out = open(a.csv, "w", newline="") if a.csv else None
    if out:
        csv.writer(out).writerow(["trace", "kernel", "kind", "launches_per_step", "us_per_step",
                                  "us_per_launch", "min_us"])
    for p in a.traces:
        summary(p, a.top, out)
    if out:
        out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
