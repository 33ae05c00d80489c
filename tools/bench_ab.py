#!/usr/bin/env python3
"""Summary of an A/B benchmark run: the JSON files of one benchmark (msa_bench, moe_bench,
linear_bench, mem_bench) written by several builds ("labels") in alternating repetitions.

  bench_ab.py [--base LABEL] [--metrics REGEX] [--json OUT] FILE...   FILE = <dir>/<label>.<rep>.json

Rows are matched across files by their identity (every field of a row that is not a float and
not a compared metric: mode, context, batch, dtype, name, ...; strings that describe results,
such as the dispatch entries or the target verdict, are left out). For every metric matching --metrics (default:
fields ending in _us) the table gives each label's range over its repetitions and the median's
change against the base label (--base; default: the label of the first FILE); a row or metric missing in some label is shown as "-".
Exit status 2 on unreadable input, with the file and the reason.
"""
import argparse
import json
import os
import re
import statistics
import sys

# String fields that report a result rather than name the row (the plans too: builds compared
# may split the same row differently).
RESULT_FIELDS = {"entries", "step_fast_entries", "target", "status", "note", "dispatch", "plan", "indexer_plan",
                 "attention_plan"}


def fail(msg):
    print(f"bench_ab: {msg}", file=sys.stderr)
    sys.exit(2)


def label_of(path):
    base = os.path.basename(path)
    m = re.fullmatch(r"(.+)\.(\d+)\.json", base)
    if not m:
        fail(f"{path}: the name is not <label>.<rep>.json")
    return m.group(1), int(m.group(2))


def rows_of(path):
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        fail(f"{path}: {e}")
    if not isinstance(doc, dict):
        fail(f"{path}: the top level is not an object")
    rows = doc.get("rows")
    if rows is None:
        rows = [{k: v for k, v in doc.items() if not isinstance(v, (dict, list))}]
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        fail(f"{path}: 'rows' is not a list of objects")
    return rows


def identity(row, metric_re):
    return tuple(sorted((k, v) for k, v in row.items()
                        if not isinstance(v, (float, dict, list)) and k not in RESULT_FIELDS and not metric_re.search(k)))


def fmt_id(ident):
    return " ".join(f"{k}={v}" for k, v in ident) or "(all)"


def summarize(files, metric_re, base_label=None):
    # data[ident][metric][label] = [values by repetition]
    data, labels, order = {}, [], []
    for path in sorted(files, key=lambda p: label_of(p)[1]):
        label, _ = label_of(path)
        if label not in labels:
            labels.append(label)
        for row in rows_of(path):
            ident = identity(row, metric_re)
            if ident not in data:
                data[ident] = {}
                order.append(ident)
            for k, v in row.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and metric_re.search(k):
                    data[ident].setdefault(k, {}).setdefault(label, []).append(float(v))
    # Labels in the order their first file appears on the command line.
    first = {}
    for i, path in enumerate(files):
        first.setdefault(label_of(path)[0], i)
    labels.sort(key=lambda l: first[l])
    if base_label is not None:
        if base_label not in labels:
            fail(f"--base {base_label}: no file of that label (labels: {', '.join(labels)})")
        labels.remove(base_label)
        labels.insert(0, base_label)
    out = []
    for ident in order:
        for metric in sorted(data[ident]):
            per = data[ident][metric]
            entry = {"row": dict(ident), "metric": metric, "labels": {}}
            base = statistics.median(per[labels[0]]) if labels[0] in per else None
            for label in labels:
                vals = per.get(label)
                if not vals:
                    continue
                med = statistics.median(vals)
                entry["labels"][label] = {
                    "min": min(vals), "max": max(vals), "median": med, "n": len(vals),
                    "change": (med / base - 1.0) if base else None,
                }
            out.append(entry)
    return labels, out


def print_table(labels, out):
    width = max([len(fmt_id(tuple(e["row"].items()))) + len(e["metric"]) + 1 for e in out] + [10])
    print(f"{'row metric':<{width}} | " + " | ".join(f"{l:>24}" for l in labels))
    for e in out:
        cells = []
        for label in labels:
            s = e["labels"].get(label)
            if s is None:
                cells.append(f"{'-':>24}")
                continue
            rng = f"{s['min']:.1f}-{s['max']:.1f}" if s["n"] > 1 else f"{s['min']:.1f}"
            chg = "" if s["change"] is None or label == labels[0] else f" {100 * s['change']:+.1f}%"
            cells.append(f"{rng + chg:>24}")
        name = fmt_id(tuple(sorted(e["row"].items()))) + " " + e["metric"]
        print(f"{name:<{width}} | " + " | ".join(cells))


def main(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--base", help="the label the others are compared with (default: the first file's)")
    ap.add_argument("--metrics", default=r"_us$", help="regex of the metrics to compare (default: _us$)")
    ap.add_argument("--json", help="write the summary here")
    args = ap.parse_args(argv)
    try:
        metric_re = re.compile(args.metrics)
    except re.error as e:
        fail(f"--metrics: {e}")
    labels, out = summarize(args.files, metric_re, args.base)
    if not out:
        fail("no metric matched in any row")
    print_table(labels, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"labels": labels, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
