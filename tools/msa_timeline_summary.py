#!/usr/bin/env python3
"""Summarise the phase timelines a -DM3_MSA_TIMELINE build prints (src/backend/cuda/msa_timeline.cuh).

Each call of a decode MSA kernel prints a header line ("[timeline indexer] ctas 63 entry ... ns,
SM clock 1.90 GHz") and one line per mark reached ("mark 3: 63 ctas, first 10112 last 10176").
Calls are grouped by the msa_bench table row printed after them (index dtype, context, batch;
the timelines of a step come before its row) and by (kernel, CTA count); per mark the median
over calls of the first and the last CTA's time is printed, in µs after the kernel's first CTA
started, in time order, with the CTAs' 10th / 50th / 90th percentiles where the build printed
them. (Grouping by CTA count alone mixed contexts: 128K and 512K at B = 1 both
launch 132 BF16 indexer CTAs.)

    msa_bench_tl --contexts 8192,131072 --batches 1 --index-dtypes bf16 --no-baseline \\
        --prefill none --iters 3 > tl.log
    tools/msa_timeline_summary.py tl.log
"""
import re
import statistics
import sys
from collections import defaultdict

MARKS = {
    "indexer": {
        0: "entry", 1: "group range known", 2: "setup done (exact scan: first block's keys in)",
        6: "first unit's MMAs (exact scan: first block scored)",
        7: "candidates listed", 3: "scan and exact dots done", 4: "last CTA arrived",
        8: "selection: scores loaded", 9: "selection: threshold", 10: "selection: listed",
        11: "selection: ranked", 5: "selection written",
    },
    "attention": {
        0: "entry", 1: "Q staged", 2: "past the PDL wait", 3: "selection union and pages",
        4: "units done", 5: "cluster barrier", 6: "output written",
    },
}

HEADER = re.compile(r"\[timeline (\w+)\] ctas (\d+) entry \d+ ns(?:, SM clock ([\d.]+) GHz)?")
MARK = re.compile(r"\[timeline (\w+)\] mark (\d+): (\d+) ctas, first (\d+) last (\d+)(?: p10 (\d+) p50 (\d+) p90 (\d+))?")
ROW = re.compile(r"^(bf16|fp8)\s+(\d+)\s+(\d+) \|")


def parse(lines):
    """{(row, kernel, ctas): [ {mark: (first_ns, last_ns)}, ... ]} and the clocks seen; row is the
    msa_bench table row printed after the calls ("" when none follows)."""
    calls = defaultdict(list)
    clocks = defaultdict(list)
    pending = []  # (kernel, ctas, marks, clock) not yet followed by a table row

    def assign(label, runs):
        for kernel, ctas, marks, clock in runs:
            calls[(label, kernel, ctas)].append(marks)
            if clock is not None:
                clocks[(label, kernel, ctas)].append(clock)

    current = None
    for line in lines:
        m = HEADER.search(line)
        if m:
            current = {}
            pending.append((m.group(1), int(m.group(2)), current, float(m.group(3)) if m.group(3) else None))
            continue
        m = MARK.search(line)
        if m and current is not None:
            pct = tuple(int(x) for x in m.group(6, 7, 8)) if m.group(6) else None
            current[int(m.group(2))] = (int(m.group(4)), int(m.group(5)), pct)
            continue
        m = ROW.match(line)
        if m:
            assign(f"{m.group(1)} {m.group(2)} B={m.group(3)}", pending)
            pending = []
            current = None
    assign("", pending)
    return calls, clocks


def summarise(calls, clocks):
    out = []
    for (label, kernel, ctas), runs in sorted(calls.items()):
        key = (label, kernel, ctas)
        clock = f", SM clock {statistics.median(clocks[key]):.2f} GHz" if clocks[key] else ""
        out.append(f"{label + ': ' if label else ''}{kernel}, {ctas} CTAs: {len(runs)} calls{clock}")
        marks = sorted({m for run in runs for m in run})
        rows = []
        for mark in marks:
            firsts = [run[mark][0] for run in runs if mark in run]
            lasts = [run[mark][1] for run in runs if mark in run]
            pcts = [run[mark][2] for run in runs if mark in run and run[mark][2]]
            pct = tuple(statistics.median(p[i] for p in pcts) for i in range(3)) if pcts else None
            rows.append((statistics.median(firsts), statistics.median(lasts), mark, len(firsts), pct))
        rows.sort()
        for first, last, mark, n, pct in rows:
            name = MARKS.get(kernel, {}).get(mark, f"mark {mark}")
            spread = f" (p10 / p50 / p90 {pct[0] / 1000:.2f} / {pct[1] / 1000:.2f} / {pct[2] / 1000:.2f})" if pct else ""
            out.append(f"  {first / 1000:7.2f} .. {last / 1000:7.2f} us{spread}  mark {mark:2d}  {name} ({n} calls)")
    return "\n".join(out)


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    with open(argv[1], encoding="utf-8", errors="replace") as f:
        calls, clocks = parse(f)
    if not calls:
        print(f"{argv[1]}: no timeline lines (was the build configured with -DM3_MSA_TIMELINE=ON?)", file=sys.stderr)
        return 1
    print(summarise(calls, clocks))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
