"""Compares loss curves printed by `examples/train_llama` and `scripts/gpu/train_llama.py`.

Both print a table headed `step  NAME NAME ...` with one row per step; each argument picks a
column of the first such table in a file that has it:

  python3 scripts/gpu/loss_curves.py [--exact FILE:COLUMN] FILE:COLUMN ...

It prints the largest and the mean relative gap of every pair of curves, and with `--exact`
(say PyTorch eager's f32 curve) each curve's gap to that one: how far a bf16 run strays from
the exact computation, set beside how far PyTorch's own bf16 runs do. Needs no GPU and no
packages beyond Python 3.
"""
import argparse
import itertools
import sys


def curve(spec):
    path, _, column = spec.rpartition(":")
    if not path:
        sys.exit(f"{spec}: expected FILE:COLUMN")
    lines = open(path).read().split("\n")
    for i, line in enumerate(lines):
        head = line.split()
        if head[:1] != ["step"] or column not in head:
            continue
        k = head.index(column) - 1
        values = []
        for row in lines[i + 1:]:
            cells = row.split()
            if not cells or not cells[0].isdigit():
                break
            values.append(float(cells[1 + k]))
        return values
    sys.exit(f"{path}: no table with a column {column}")


def gaps(a, b):
    n = min(len(a), len(b))
    g = [abs(x - y) / abs(y) for x, y in zip(a[:n], b[:n])]
    return max(g), sum(g) / n, g.index(max(g)) + 1, n


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exact", help="FILE:COLUMN of the curve the others are measured against")
    ap.add_argument("curves", nargs="+", help="FILE:COLUMN")
    a = ap.parse_args()
    runs = {spec: curve(spec) for spec in a.curves}
    width = max(len(s) for s in runs)
    print("pair: largest relative gap (at step), mean relative gap, steps")
    for x, y in itertools.combinations(runs, 2):
        mx, mean, at, n = gaps(runs[x], runs[y])
        print(f"{x:<{width}}  {y:<{width}}  {mx:.2e} ({at})  {mean:.2e}  {n}")
    if a.exact:
        exact = curve(a.exact)
        print(f"against {a.exact}:")
        for x, values in runs.items():
            mx, mean, at, n = gaps(values, exact)
            print(f"{x:<{width}}  {mx:.2e} ({at})  {mean:.2e}  {n}")


if __name__ == "__main__":
    main()
