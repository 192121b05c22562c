"""Kernel time per training step by category, from an ncu CSV of a training run (ours or
PyTorch's), as BENCHMARKS.md's step profiles are made:

  ncu --clock-control none --metrics gpu__time_duration.sum --csv --page raw \\
      ./train_llama --size llama --dtype bf16 --mode liger --steps 4 > ours.csv
  ncu ... python3 scripts/gpu/train_llama.py --size llama --dtype bf16 --modes liger \\
      --steps 4 --warmup 1 > torch.csv
  python3 scripts/gpu/kernel_time.py ours.csv --steps 4 [--top 20]

Every kernel of the run is summed by name and divided by --steps (so start-up kernels, a few
casts and fills, are spread over the steps: run few steps and read them as noise), then summed
by category: GEMM (cuBLAS), attention, optimizer (AdamW, norm, clipping), the fused ops of
liger-rs or Liger-Kernel, gradient sums and fills, casts and copies, other. `--top N` also
prints the N kernels with the most time.
"""
import argparse
import collections
import csv
import re
import sys

# (category, pattern on the kernel name), first match wins; both sides' names.
CATEGORIES = [
    ("GEMM", r"^nvjet|gemm|splitKreduce|^sm90_xmma"),
    ("attention", r"^attn_|sdpa|cudnn::|flash_"),
    ("optimizer", r"^adamw|FusedAdam|LpNorm|lpnorm|BinaryOpScalarTensor"),
    ("fused ops (liger-rs / Liger)", r"^(swiglu|geglu|rope|rms_norm|ce_|embedding)|^_|liger"),
    ("gradient sums, fills", r"^badd|^const_set|CUDAFunctor_add|FillFunctor"),
    ("casts, copies", r"^cast_|^copy|copy_kernel|bfloat16_copy"),
]
UNITS = {"nsecond": 1e-6, "ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}


def category(name):
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name):
            return cat
    return "other"


def read(path):
    """(kernel name, milliseconds) for every launch in an ncu `--csv --page raw` file."""
    rows = list(csv.reader(open(path, newline="")))
    head = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
    names = rows[head]
    k, t = names.index("Kernel Name"), names.index("gpu__time_duration.sum")
    scale = UNITS.get(rows[head + 1][t].strip(), None)
    if scale is None:
        sys.exit(f"unknown unit {rows[head + 1][t]!r} of gpu__time_duration.sum")
    out = []
    for r in rows[head + 2:]:
        if len(r) > max(k, t) and r[t].strip():
            out.append((r[k], float(r[t].replace(",", "")) * scale))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--top", type=int, default=0)
    a = ap.parse_args()
    launches = read(a.csv)
    by_kernel = collections.defaultdict(lambda: [0, 0.0])
    for name, ms in launches:
        by_kernel[name][0] += 1
        by_kernel[name][1] += ms
    by_cat = collections.defaultdict(lambda: [0, 0.0])
    for name, (n, ms) in by_kernel.items():
        c = by_cat[category(name)]
        c[0] += n
        c[1] += ms
    total = sum(ms for _, ms in launches) / a.steps
    print(f"{len(launches)} launches, {total:.2f} ms of kernel time per step ({a.steps} steps)")
    print(f"{'category':32} {'ms/step':>9} {'kernels/step':>13} {'share':>7}")
    for cat, (n, ms) in sorted(by_cat.items(), key=lambda x: -x[1][1]):
        per = ms / a.steps
        print(f"{cat:32} {per:9.2f} {n / a.steps:13.1f} {100 * per / total:6.1f}%")
    if a.top:
        print(f"\n{'ms/step':>9} {'kernels/step':>13}  kernel")
        for name, (n, ms) in sorted(by_kernel.items(), key=lambda x: -x[1][1])[: a.top]:
            print(f"{ms / a.steps:9.2f} {n / a.steps:13.1f}  {name[:120]}")


if __name__ == "__main__":
    main()
