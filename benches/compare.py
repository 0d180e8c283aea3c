#!/usr/bin/env python3
"""Joins RESULT lines (ours and cuBLAS's, from one device run) into a markdown table of time ratios.
Usage: compare.py LOG [LOG...] > table.md"""
import re
import sys

rows = {}
for path in sys.argv[1:]:
    for line in open(path):
        if not line.startswith("RESULT "):
            continue
        kv = dict(re.findall(r"(\w+)=(\S+)", line))
        key = (kv["op"],) + tuple((k, v) for k, v in kv.items() if k not in ("op", "impl", "ms", "tflops"))
        rows.setdefault(key, {})[kv["impl"]] = (float(kv["ms"]), float(kv["tflops"]))

print("| op | shape | impl | ms | TFLOP/s | cuBLAS ms | time ratio (ours / cuBLAS) | throughput ratio |")
print("|---|---|---|---|---|---|---|---|")
for key in sorted(rows):
    impls = rows[key]
    base = impls.get("cuBLAS")
    shape = " ".join(f"{k}={v}" for k, v in key[1:])
    for imp, (ms, tf) in sorted(impls.items()):
        if imp == "cuBLAS":
            continue
        if base:
            print(f"| {key[0]} | {shape} | {imp} | {ms:.3f} | {tf:.0f} | {base[0]:.3f} | {ms / base[0]:.2f} | {base[0] / ms:.2f} |")
        else:
            print(f"| {key[0]} | {shape} | {imp} | {ms:.3f} | {tf:.0f} | — | — | — |")
