"""Anchor for the fused residual add + RMSNorm rows of `cargo bench` (benches/ops.rs,
`fused_add_fwd` / `fused_add_bwd`): Liger's `LigerFusedAddRMSNormFunction` forward and backward
on the same shapes (bf16 16384×4096 and 16384×2048, llama mode, a weight with dW), timed with
triton's do_bench (median; it flushes L2 before each call, which at these sizes, 64–128 MiB
per tensor, changes little), and for reference PyTorch eager's `x + r` then HF's RMSNorm
(`torch`).

Usage on a GPU machine with torch and triton (Liger-Kernel 0.8.5 for `liger`), in the same
device call as `cargo bench` so that both see the same GPU:
    python3 -m pip install -q --no-deps --target /tmp/liger liger-kernel==0.8.5
    PYTHONPATH=/tmp/liger python3 scripts/gpu/fused_add_anchor.py liger|torch
Prints CSV rows: impl, op, shape, dtype, median µs, GB/s on the minimum bytes the fused op must
move, as `cargo bench` counts them (forward reads x, r and writes s, y: 4·M·N·s; backward reads
dY, dS, S and writes dX: 4·M·N·s)."""
import sys

import torch
from triton.testing import do_bench

dev = "cuda"
impl = sys.argv[1] if len(sys.argv) > 1 else "liger"
EPS = 1e-6


def emit(op, shape, dt, us, nbytes):
    print(f"{impl},{op},{shape},{str(dt).replace('torch.', '')},{us:.2f},{nbytes / us / 1e3:.0f}",
          flush=True)


def median_us(fn):
    return do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3


def case(M, H, dt):
    s = torch.tensor([], dtype=dt).element_size()
    x = torch.randn(M, H, device=dev, dtype=dt, requires_grad=True)
    r = torch.randn(M, H, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(H, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(M, H, device=dev, dtype=dt)
    ds = torch.randn(M, H, device=dev, dtype=dt)
    if impl == "liger":
        from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
        f = lambda: LigerFusedAddRMSNormFunction.apply(x, r, w, EPS, 0.0, "llama", False)
    else:
        def f():
            s_ = x + r
            h = s_.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
            return w * h.to(dt), s_
    fwd = median_us(f)
    y, s_out = f()

    def bwd():
        x.grad = r.grad = w.grad = None
        torch.autograd.backward((y, s_out), (dy, ds), retain_graph=True)
    shape = f"{M}x{H}"
    emit("fused_add_fwd", shape, dt, fwd, 4 * M * H * s)
    emit("fused_add_bwd", shape, dt, median_us(bwd), 4 * M * H * s)


print("impl,op,shape,dtype,median_us,gbps", flush=True)
for H in (4096, 2048):
    case(16384, H, torch.bfloat16)
