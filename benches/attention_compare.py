#!/usr/bin/env python3
"""Joins the RESULT lines of benches/attention_report.rs and benches/sdpa_reference.py (one device run) into
markdown tables: per case and per implementation of ours, its time beside PyTorch's (SDPA for attention,
F.rms_norm, else the plain torch ops, for RMSNorm) and Burn's, with the ratios and the achieved GB/s; then every
implementation of every case; then the SKIP and MEMORY lines.
Usage: attention_compare.py LOG [LOG...] > attention_table.md"""
import re
import sys

# Fields that describe a measurement, not the case.
MEASURES = {"op", "impl", "ms", "tflops", "gbps", "peak_frac", "sdpa_backend", "gqa"}
ORDER = ["attn_prefill_fwd", "attn_prefill_fwd_bwd", "attn_decode_full", "attn_decode_ragged", "attn_decode_long",
         "rms_norm_fwd", "rms_norm_fwd_bwd"]

rows, notes = {}, []
for path in sys.argv[1:]:
    try:
        lines = open(path).read().splitlines()
    except OSError as e:
        notes.append(f"{path}: {e}")
        continue
    for line in lines:
        if line.startswith(("SKIP", "MEMORY", "NOTICE")) and line.strip() not in notes:
            notes.append(line.strip())
        if not line.startswith("RESULT "):
            continue
        kv = dict(re.findall(r"(\w+)=(\S+)", line))
        if "op" not in kv or "impl" not in kv or "ms" not in kv:
            continue
        key = (kv["op"],) + tuple((k, v) for k, v in kv.items() if k not in MEASURES)
        rows.setdefault(key, {})[kv["impl"]] = kv


def order(key):
    return (ORDER.index(key[0]) if key[0] in ORDER else len(ORDER), key)


def reference(impls):
    for name in ("SDPA", "TorchRmsNorm", "TorchOps"):
        if name in impls:
            label = name
            if impls[name].get("sdpa_backend"):
                label += f" ({impls[name]['sdpa_backend']}, gqa {impls[name].get('gqa', '?')})"
            return label, impls[name]
    return None, None


def burn(op, impls):
    prefer = ("BurnUser", "Burn") if op.endswith("fwd_bwd") else ("Burn", "BurnUser")
    for name in prefer:
        if name in impls:
            return name, impls[name]
    return None, None


def ms(kv):
    return float(kv["ms"]) if kv else None


def fmt(x, digits=3):
    return "—" if x is None else f"{x:.{digits}f}"


def ratio(a, b):
    return "—" if a is None or b is None or b == 0 else f"{a / b:.2f}"


def gb(kv):
    if not kv or "gbps" not in kv:
        return "—"
    return f"{kv['gbps']} ({float(kv['peak_frac']) * 100:.0f}%)"


print("| case | shape | ours | ours ms | reference | ref ms | ours / ref | Burn | Burn ms | Burn / ref "
      "| ours GB/s (of 3.35 TB/s) | ref GB/s |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for key in sorted(rows, key=order):
    impls = rows[key]
    op, shape = key[0], " ".join(f"{k}={v}" for k, v in key[1:])
    ref_name, ref = reference(impls)
    burn_name, bkv = burn(op, impls)
    ours = sorted(i for i in impls if i.startswith("Invariant")) or [None]
    for imp in ours:
        okv = impls.get(imp) if imp else None
        print(f"| {op} | {shape} | {imp or '—'} | {fmt(ms(okv))} | {ref_name or '—'} | {fmt(ms(ref))} "
              f"| {ratio(ms(okv), ms(ref))} | {burn_name or '—'} | {fmt(ms(bkv))} | {ratio(ms(bkv), ms(ref))} "
              f"| {gb(okv)} | {gb(ref)} |")

print()
print("All implementations:")
print()
print("| case | shape | impl | ms | TFLOP/s | GB/s (of 3.35 TB/s) | notes |")
print("|---|---|---|---|---|---|---|")
for key in sorted(rows, key=order):
    op, shape = key[0], " ".join(f"{k}={v}" for k, v in key[1:])
    for imp, kv in sorted(rows[key].items(), key=lambda e: float(e[1]["ms"])):
        extra = " ".join(f"{k}={kv[k]}" for k in ("sdpa_backend", "gqa") if k in kv)
        print(f"| {op} | {shape} | {imp} | {float(kv['ms']):.3f} | {kv.get('tflops', '—')} | {gb(kv)} "
              f"| {extra} |")

if notes:
    print()
    print("Notes:")
    print()
    for n in notes:
        print(f"- `{n}`")
