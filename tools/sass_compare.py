#!/usr/bin/env python3
"""Compares the kernels of two `cuobjdump -sass` listings (tools/sass_same.sh).

Kernels are matched by name with the anonymous namespace's path-derived tag removed; each body
is compared instruction by instruction, control words included, with addresses and whitespace
dropped. A kernel present on one side only is matched, where possible, to one whose body is the
same on the other side (a kernel that became a template instantiation). Exit 0 when every kernel
now has a same-SASS counterpart at the base, 1 otherwise.
  sass_compare.py LABEL REV BASE.sass NEW.sass
"""
import difflib
import re
import sys


def kernels(path):
    out, cur = {}, None
    for line in open(path, encoding="utf-8", errors="replace"):
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = re.sub(r"_GLOBAL__N__[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}", "_GLOBAL__N_", m.group(1))
            out[cur] = []
            continue
        if cur is None or "identifier =" in line or not line.strip():
            continue
        body = re.sub(r"/\*[0-9a-f]{4,}\*/", "", line)
        out[cur].append(" ".join(body.split()))
    return out


def main():
    label, rev, base_path, new_path = sys.argv[1:5]
    base, new = kernels(base_path), kernels(new_path)
    by_body = {}
    for name, body in base.items():
        by_body.setdefault("\n".join(body), name)
    same, changed, matched = [], [], []
    for name, body in new.items():
        if name in base:
            (same if base[name] == body else changed).append(name)
        elif "\n".join(body) in by_body:
            matched.append((name, by_body["\n".join(body)]))
        else:
            changed.append(name)
    lines = sum(len(b) for b in new.values())
    if not changed:
        print(f"sass_same: {label}: same SASS as {rev} ({len(new)} kernels, {lines} lines)")
        for name, old in matched:
            print(f"  {name} = {old} at {rev}")
        return 0
    print(f"sass_same: {label}: {len(changed)} of {len(new)} kernels differ from {rev}:")
    for name, old in matched:
        print(f"  same: {name} = {old} at {rev}")
    for name in changed:
        print(f"  {name}" + ("" if name in base else " (no kernel of this name or body at the base)"))
    first = changed[0]
    if first in base:
        diff = difflib.unified_diff(base[first], new[first], lineterm="", n=0)
        print("\n".join(list(diff)[:40]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
