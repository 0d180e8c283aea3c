#!/usr/bin/env python3
"""The RL head's cost beside the plain call, from a `gpu_report rl` log (same run, same process).

Usage: rl_head_ratios.py report.log. For each (op, implementation, shape): the plain time and the
times at temperature 0.7 (`+T0.7`) and with entropy (`+T0.7+ent`), as multiples of the plain one.
"""
import re
import sys

rows = {}
for line in open(sys.argv[1]):
    if not line.startswith("RESULT "):
        continue
    f = dict(kv.split("=", 1) for kv in line.split()[1:])
    if not f["op"].startswith("linear_logp"):
        continue
    base, _, head = f["impl"].partition("+")
    shape = f"v={f['v']}"
    rows.setdefault((f["op"], base, shape), {})[head] = float(f["ms"])

print("| op | impl | shape | plain ms | T=0.7 ms | T=0.7 + entropy ms | T / plain | T + entropy / plain |")
print("|---|---|---|---|---|---|---|---|")
for (op, base, shape), t in sorted(rows.items()):
    plain = t.get("")
    if plain is None:
        continue
    cell = lambda k: f"{t[k]:.3f}" if k in t else "–"
    ratio = lambda k: f"{t[k] / plain:.3f}" if k in t else "–"
    print(f"| {op} | {base} | {shape} | {plain:.3f} | {cell('T0.7')} | {cell('T0.7+ent')} | {ratio('T0.7')} | {ratio('T0.7+ent')} |")
