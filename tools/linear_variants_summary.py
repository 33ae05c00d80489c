#!/usr/bin/env python3
"""Summarises `linear_bench --variants` (its JSON): per shape and row count, the microseconds of
the table's own choice ("mma", or "group" for attn_proj) and of every forced kernel, the fastest
marked, and whether every forced output had the table's bits (max_rel 0).

  linear_variants_summary.py linear_bench.json [more.json]   (several runs: per-cell medians)
"""
import json
import statistics
import sys
from collections import defaultdict

ORDER = ["mma", "group", "wgmma", "wgmma_ov", "narrow", "nosplit", "wide", "auto"]


def main():
    if len(sys.argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    cells = defaultdict(list)  # (shape, m, what) -> [us]
    entries, bad = {}, []
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        for r in doc["rows"]:
            what = r["what"]
            if what in ("rowdot", "cublas", "separate"):
                continue
            key = (r["shape"], r["m"], what)
            cells[key].append(r["us"])
            entries[key] = r["entry"]
            if what not in ("mma", "group") and r.get("max_rel", 0) not in (0, 0.0, -1):
                bad.append(f"{r['shape']} m={r['m']} {what}: max_rel {r['max_rel']:.3g}")
    shapes = sorted({k[0] for k in cells}, key=lambda s: s)
    for shape in shapes:
        whats = [w for w in ORDER if any(k[0] == shape and k[2] == w for k in cells)]
        rows = sorted({k[1] for k in cells if k[0] == shape})
        print(f"\n{shape}: µs (median of runs), * fastest")
        print("| rows | " + " | ".join(whats) + " | fastest |")
        print("|---|" + "---|" * (len(whats) + 1))
        for m in rows:
            vals = {w: statistics.median(cells[(shape, m, w)]) for w in whats if (shape, m, w) in cells}
            best = min(vals, key=vals.get)
            line = []
            for w in whats:
                line.append("" if w not in vals else f"{vals[w]:.1f}" + ("*" if w == best else ""))
            table = vals.get("mma", vals.get("group"))
            gain = f" ({100 * (1 - vals[best] / table):.0f} % under the table)" if table and best not in ("mma", "group") else ""
            print(f"| {m} | " + " | ".join(line) + f" | {best}{gain} |")
    if bad:
        print("\nFORCED KERNELS WITH OTHER BITS THAN THE TABLE'S:")
        print("\n".join(bad))
        return 1
    print("\nEvery forced kernel gave the table's bits.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
