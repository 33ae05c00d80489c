#!/usr/bin/env python3
"""Summarises `linear_bench --variants` (its JSON): per shape and row count, the microseconds of
the table's own choice ("mma", or "group" for attn_proj) and of every forced kernel, the fastest
marked, and whether every forced output had the table's bits (max_rel 0); then the
MmaLinearRule (wgmma_min_rows, narrow_max_rows, wgmma_overlap; split_fill as the forced kernels
ran it) that minimises the summed time over the sweep, against the table's own choices.

  linear_variants_summary.py linear_bench.json [more.json]   (several runs: per-cell medians)
"""
import json
import statistics
import sys
from collections import defaultdict

ORDER = ["mma", "group", "wgmma", "wgmma_ov", "narrow", "nosplit", "wide", "auto"]


def suggest(cells, shapes):
    """The rule over the swept rows: rows >= wgmma_min_rows take wgmma (plain or overlapped), the
    rest 32-token narrow tiles up to narrow_max_rows and the wide tile above. Scored by the summed
    median time of the forced kernels over every shape that has them all."""
    med = {k: statistics.median(v) for k, v in cells.items()}
    need = ("wgmma", "wgmma_ov", "narrow", "wide")
    use = [s for s in shapes if all(any(k[0] == s and k[2] == w for k in med) for w in need)]
    if not use:
        print("\nNo shape has all of " + ", ".join(need) + ": no rule suggested.")
        return None
    rows = {s: sorted({k[1] for k in med if k[0] == s}) for s in use}
    all_rows = sorted({m for s in use for m in rows[s]})
    inf = float("inf")

    def kernel(m, t, n, ov):
        return ("wgmma_ov" if ov else "wgmma") if m >= t else ("narrow" if m <= n else "wide")

    best = None  # the engine's values first, so that a tie keeps them (MmaLinearRule's defaults)
    for ov in (False, True):
        for t in [512] + all_rows + [inf]:
            for n in [256, 0] + all_rows:
                total = 0.0
                for s in use:
                    for m in rows[s]:
                        v = med.get((s, m, kernel(m, t, n, ov)))
                        total += inf if v is None else v
                if best is None or total < best[0] - 1e-9:
                    best = (total, t, n, ov)
    total, t, n, ov = best
    table = sum(med.get((s, m, "mma"), med.get((s, m, "group"), 0.0)) for s in use for m in rows[s])
    worst = max(((med[(s, m, kernel(m, t, n, ov))] / min(med[(s, m, w)] for w in need if (s, m, w) in med) - 1, s, m)
                 for s in use for m in rows[s]), default=(0, "", 0))
    t_txt = "never" if t == inf else str(t)
    n_txt = str(n) if any(m < t for m in all_rows) else f"{n} (no swept row takes mma.sync under this rule)"
    versus = ""
    if table:
        d = 100 * (1 - total / table)
        versus = f", against {table:.1f} µs for the table's choices ({abs(d):.1f} % {'less' if d >= 0 else 'more'})"
    print(f"\nSuggested rule over {len(use)} shapes: wgmma_min_rows = {t_txt}, narrow_max_rows = {n_txt}, "
          f"wgmma_overlap = {'true' if ov else 'false'}: {total:.1f} µs summed{versus}")
    print(f"largest loss of the rule in one cell against that cell's fastest kernel: {100 * worst[0]:.1f} % "
          f"({worst[1]}, {worst[2]} rows)")
    return best


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
    suggest(cells, shapes)
    if bad:
        print("\nFORCED KERNELS WITH OTHER BITS THAN THE TABLE'S:")
        print("\n".join(bad))
        return 1
    print("\nEvery forced kernel gave the table's bits.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
