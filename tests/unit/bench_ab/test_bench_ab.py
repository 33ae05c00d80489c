#!/usr/bin/env python3
"""tools/bench_ab.py: rows matched by identity across labels and repetitions, ranges, medians'
changes against the base label, missing rows and metrics, and clear errors on bad input."""
import json
import os
import subprocess
import sys
import tempfile

TOOL = sys.argv[1]
failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"FAIL: {what}")


def run(*args):
    p = subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True)
    return p.returncode, p.stdout, p.stderr


def write(d, name, doc):
    path = os.path.join(d, name)
    with open(path, "w") as f:
        if isinstance(doc, str):
            f.write(doc)
        else:
            json.dump(doc, f)
    return path


def bench(step_8k, step_32k, extra_row=False):
    rows = [
        {"mode": "prefill", "context": 8192, "batch": 1, "step_us": step_8k, "tflops": 1.5, "target": "MISSED",
         "entries": f"attention=x{step_8k}"},
        {"mode": "prefill", "context": 32768, "batch": 1, "step_us": step_32k, "idx_us": 5.0, "target": "met"},
    ]
    if extra_row:
        rows.append({"mode": "decode", "context": 8192, "batch": 64, "step_us": 7.0})
    return {"device": "test", "copy_bandwidth_gbps": 4000.0, "rows": rows}


with tempfile.TemporaryDirectory() as d:
    files = [
        write(d, "head.1.json", bench(100.0, 400.0)),
        write(d, "new.1.json", bench(90.0, 380.0, extra_row=True)),
        write(d, "head.2.json", bench(110.0, 410.0)),
        write(d, "new.2.json", bench(92.0, 390.0, extra_row=True)),
        write(d, "head.3.json", bench(102.0, 420.0)),
        write(d, "new.3.json", bench(94.0, 400.0, extra_row=True)),
    ]
    out = os.path.join(d, "summary.json")
    rc, stdout, stderr = run("--json", out, *files)
    check(rc == 0, f"exit 0 on good input (got {rc}: {stderr})")
    s = json.load(open(out))
    check(s["labels"] == ["head", "new"], f"labels in command-line order, got {s['labels']}")
    by = {(e["row"].get("context"), e["row"].get("mode"), e["metric"]): e for e in s["rows"]}
    e = by.get((8192, "prefill", "step_us"))
    check(e is not None, "the 8K prefill step_us row (result strings such as entries do not split rows)")
    if e:
        h, n = e["labels"]["head"], e["labels"]["new"]
        check((h["min"], h["max"], h["median"], h["n"]) == (100.0, 110.0, 102.0, 3), f"head range/median (not mean) {h}")
        check((n["min"], n["max"], n["median"]) == (90.0, 94.0, 92.0), f"new range/median {n}")
        check(abs(n["change"] - (92.0 / 102.0 - 1.0)) < 1e-12, f"new change {n['change']}")
        check(h["change"] == 0.0, "the base's change is 0")
    check((32768, "prefill", "idx_us") in by, "other *_us metrics are compared")
    check(not any(k[2] == "tflops" for k in by), "metrics outside --metrics are left out")
    d8 = by.get((8192, "decode", "step_us"))
    check(d8 is not None and "head" not in d8["labels"] and d8["labels"]["new"]["change"] is None,
          "a row one label lacks: shown for the other, no change")
    line = [l for l in stdout.splitlines() if "mode=decode" in l and "step_us" in l]
    cells = [c.strip() for c in line[0].split("|")] if line else []
    check(cells[1:] == ["-", "7.0-7.0"] or cells[1:] == ["-", "7.0"] or (len(cells) == 3 and cells[1] == "-"),
          f"the table shows '-' where a label lacks the row ({cells})")
    line = [l for l in stdout.splitlines() if "context=8192" in l and "mode=prefill" in l and "step_us" in l]
    check(bool(line) and "100.0-110.0" in line[0] and "90.0-94.0 -9.8%" in line[0], f"the table's 8K row ({line})")

    # --base picks the reference; --metrics selects others.
    rc, stdout, _ = run("--base", "new", "--metrics", "tflops", "--json", out, *files)
    s = json.load(open(out))
    check(rc == 0 and s["labels"][0] == "new", f"--base new first, got {s['labels']}")
    check(all(e["metric"] == "tflops" for e in s["rows"]), "--metrics tflops")

    # Errors name the file and the reason, with exit status 2.
    bad = write(d, "broken.1.json", "{not json")
    rc, _, stderr = run(files[0], bad)
    check(rc == 2 and "broken.1.json" in stderr, f"malformed JSON: exit 2 naming the file ({rc}, {stderr!r})")
    odd = write(d, "noreps.json", bench(1.0, 2.0))
    rc, _, stderr = run(odd)
    check(rc == 2 and "<label>.<rep>.json" in stderr, f"a file name without label.rep ({rc}, {stderr!r})")
    rows_bad = write(d, "x.1.json", {"rows": [1, 2]})
    rc, _, stderr = run(rows_bad)
    check(rc == 2 and "rows" in stderr, f"rows that are not objects ({rc}, {stderr!r})")
    rc, _, stderr = run("--base", "nope", *files)
    check(rc == 2 and "nope" in stderr, f"--base of an absent label ({rc}, {stderr!r})")
    rc, _, stderr = run("--metrics", "no_such_metric$", *files)
    check(rc == 2 and "no metric" in stderr, f"nothing matched ({rc}, {stderr!r})")
    rc, _, stderr = run("--metrics", "(", *files)
    check(rc == 2 and "--metrics" in stderr, f"a bad regex ({rc}, {stderr!r})")

    # An integer-valued metric is a metric, not part of the row's name.
    ints = [write(d, "i.1.json", {"rows": [{"context": 8, "step_us": 10}]}),
            write(d, "j.1.json", {"rows": [{"context": 8, "step_us": 12}]})]
    rc, _, _ = run("--json", out, *ints)
    s = json.load(open(out))
    check(rc == 0 and len(s["rows"]) == 1 and set(s["rows"][0]["labels"]) == {"i", "j"},
          f"integer metrics compared, not matched as identity ({s['rows']})")

    # A benchmark without rows (mem_bench-like): its top-level numbers are one row.
    flat = [write(d, "a.1.json", {"copy_us": 10.0, "name": "copy"}), write(d, "b.1.json", {"copy_us": 8.0, "name": "copy"})]
    rc, _, _ = run("--json", out, *flat)
    s = json.load(open(out))
    check(rc == 0 and len(s["rows"]) == 1 and abs(s["rows"][0]["labels"]["b"]["change"] + 0.2) < 1e-12,
          "top-level numbers as one row")

print("bench_ab: all checks passed" if not failures else f"bench_ab: {len(failures)} check(s) failed")
sys.exit(1 if failures else 0)
