"""GEGLU against HF's MLP and Liger-Kernel 0.8.5 in bf16 and f16.

`write DIR` runs an HF-style gated MLP, `down_proj(gelu(gate_proj(x)) * up_proj(x))` in the
dtype (as HF's Gemma MLP computes it, PyTorch autograd throughout), at the shapes of Liger's
`test_geglu.py` (tokens 2 x 256; hidden 2048 / intermediate 4096 and 341 / 4231), for the tanh
and the exact (erf) GELU, and saves the gate `a = gate_proj(x)`, the up projection
`b = up_proj(x)`, the product's incoming gradient `dc`, and HF's `c`, `da`, `db`, with Liger's
`LigerGELUMulFunction` outputs beside them (tanh only: Liger has no erf form).
`cargo bench --bench ops -- --torch-cases DIR` then writes liger-rs's outputs, and
`compare DIR` prints, per case, the share of elements equal to HF's bit for bit and the
largest difference for liger-rs and Liger, then the MLP-level gradients (dx, dW_gate,
dW_up, dW_down, with torch's GEMMs on liger-rs's c, da, db) against HF's under Liger's
test tolerances (atol = rtol = 1e-2)."""
import os
import sys
import zlib
import torch
import torch.nn.functional as F

dev = "cuda"
SHAPES = [(512, 2048, 4096), (512, 341, 4231)]
DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
TOL = 1e-2


def mlp(name, tokens, hidden, inter, form, dt):
    """The MLP's tensors for one case: inputs, weights, HF's intermediate values and grads
    (the same bits at every call: the seed is the case's name)."""
    torch.manual_seed(zlib.crc32(name.encode()))
    approx = "tanh" if form == "tanh" else "none"
    x = torch.randn(tokens, hidden, device=dev, dtype=dt, requires_grad=True)
    wg, wu = (torch.randn(inter, hidden, device=dev, dtype=dt) / hidden**0.5 for _ in range(2))
    wd = torch.randn(hidden, inter, device=dev, dtype=dt) / inter**0.5
    for w in (wg, wu, wd):
        w.requires_grad_(True)
    a, b = x @ wg.t(), x @ wu.t()
    a.retain_grad()
    b.retain_grad()
    c = F.gelu(a, approximate=approx) * b
    c.retain_grad()
    out = c @ wd.t()
    dout = torch.randn_like(out)
    out.backward(dout)
    return dict(x=x, wg=wg, wu=wu, wd=wd, a=a, b=b, c=c, dout=dout)


def save(path, t):
    t.detach().contiguous().view(torch.int16).cpu().numpy().tofile(path)


def load(path, dt, shape):
    import numpy as np

    raw = torch.from_numpy(np.fromfile(path, dtype=np.int16).copy())
    return raw.view(dt).reshape(shape).to(dev)


def cases():
    for dname in DTYPES:
        for form in ("tanh", "erf"):
            for tokens, hidden, inter in SHAPES:
                yield f"{form}_{dname}_{hidden}x{inter}", tokens, hidden, inter, form, dname


def write(d):
    os.makedirs(d, exist_ok=True)
    try:
        from liger_kernel.ops.geglu import LigerGELUMulFunction
    except ImportError as e:
        print(f"Liger-Kernel not importable ({e}): HF only")
        LigerGELUMulFunction = None
    with open(f"{d}/cases.txt", "w") as meta:
        for name, tokens, hidden, inter, form, dname in cases():
            m = mlp(name, tokens, hidden, inter, form, DTYPES[dname])
            meta.write(f"{name} {tokens} {inter} {form} {dname}\n")
            save(f"{d}/{name}.a", m["a"])
            save(f"{d}/{name}.b", m["b"])
            save(f"{d}/{name}.dc", m["c"].grad)
            for part, t in (("c", m["c"]), ("da", m["a"].grad), ("db", m["b"].grad)):
                save(f"{d}/{name}.hf.{part}", t)
            if LigerGELUMulFunction is not None and form == "tanh":
                a = m["a"].detach().clone().requires_grad_(True)
                b = m["b"].detach().clone().requires_grad_(True)
                c = LigerGELUMulFunction.apply(a, b)
                c.backward(m["c"].grad)
                for part, t in (("c", c), ("da", a.grad), ("db", b.grad)):
                    save(f"{d}/{name}.liger.{part}", t)
            print(f"{name}: written")


def close(got, want):
    """Elements outside Liger's tolerances, and the largest absolute difference."""
    got, want = got.float(), want.float()
    bad = ((got - want).abs() > TOL + TOL * want.abs()).sum().item()
    return bad, (got - want).abs().max().item()


def compare(d):
    print("case,impl,output,bitwise_equal_pct,outside_tol,max_abs_diff")
    for name, tokens, hidden, inter, form, dname in cases():
        dt = DTYPES[dname]
        shape = (tokens, inter)
        hf = {p: load(f"{d}/{name}.hf.{p}", dt, shape) for p in ("c", "da", "db")}
        impls = ["ours"] + (["liger"] if os.path.exists(f"{d}/{name}.liger.c") else [])
        for imp in impls:
            got = {p: load(f"{d}/{name}.{imp}.{p}", dt, shape) for p in ("c", "da", "db")}
            for p in ("c", "da", "db"):
                eq = (got[p].view(torch.int16) == hf[p].view(torch.int16)).float().mean().item()
                bad, worst = close(got[p], hf[p])
                print(f"{name},{imp},{p},{100 * eq:.3f},{bad},{worst:.3e}")
        # The MLP's gradients with liger-rs's elementwise results and torch's GEMMs, against
        # HF's own (the same weights, inputs and upstream gradient).
        m = mlp(name, tokens, hidden, inter, form, dt)
        saved = load(f"{d}/{name}.a", dt, shape).view(torch.int16)
        if not torch.equal(m["a"].detach().view(torch.int16), saved):
            print(f"{name}: the MLP did not replay bit for bit; its rows below compare other inputs")
        c, da, db = (load(f"{d}/{name}.ours.{p}", dt, shape) for p in ("c", "da", "db"))
        ours = {
            "out": c @ m["wd"].t(),
            "dx": da @ m["wg"] + db @ m["wu"],
            "dW_gate": da.t() @ m["x"].detach(),
            "dW_up": db.t() @ m["x"].detach(),
            "dW_down": m["dout"].t() @ c,
        }
        theirs = {
            "out": (m["c"] @ m["wd"].t()).detach(),
            "dx": m["x"].grad,
            "dW_gate": m["wg"].grad,
            "dW_up": m["wu"].grad,
            "dW_down": m["wd"].grad,
        }
        for k in ours:
            bad, worst = close(ours[k], theirs[k])
            print(f"{name},ours_mlp,{k},,{bad},{worst:.3e}")


if __name__ == "__main__":
    {"write": write, "compare": compare}[sys.argv[1]](sys.argv[2])
