"""Small-shape anchors, timed the way `cargo bench` times liger-rs (benches/ops.rs).

The large-shape anchors in BENCHMARKS.md use triton's do_bench, which flushes the L2 cache before
every call; the small shapes here fit in the 60 MB L2, and for them launch overhead is part of
what a training step pays. So each call is bracketed by its own pair of CUDA events, back to
back with no flush (10 warm-up calls, 100 timed, median), exactly as benches/ops.rs does: host
launch overhead that leaves the GPU idle counts, for Liger's Python/Triton launch as for ours.

Usage on a GPU machine with torch and triton (Liger-Kernel 0.8.5 for `liger`):
    python3 -m pip install -q --no-deps --target /tmp/liger liger-kernel==0.8.5
    PYTHONPATH=/tmp/liger python3 scripts/gpu/anchors_small.py torch|compile|liger
Prints CSV rows: impl, op, shape, dtype, median µs, GB/s on the minimum bytes each op must move
(as `cargo bench` counts them: BENCHMARKS.md, "Large shapes")."""
import sys
import torch

dev = "cuda"
impl = sys.argv[1] if len(sys.argv) > 1 else "torch"
WARMUP, REPS = 10, 100


def median_us(fn):
    for _ in range(WARMUP):
        fn()
    pairs = []
    for _ in range(REPS):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    t = sorted(s.elapsed_time(e) * 1e3 for s, e in pairs)
    return t[REPS // 2]


def emit(op, shape, dt, us, nbytes):
    print(f"{impl},{op},{shape},{str(dt).replace('torch.', '')},{us:.2f},{nbytes / us / 1e3:.0f}",
          flush=True)


def rms_case(M, H, dt):
    s = torch.tensor([], dtype=dt).element_size()
    x = torch.randn(M, H, device=dev, dtype=dt, requires_grad=True)
    w = torch.randn(H, device=dev, dtype=dt, requires_grad=True)
    dy = torch.randn(M, H, device=dev, dtype=dt)
    if impl in ("torch", "compile"):
        def hf(x, w, eps=1e-6):
            h = x.to(torch.float32)
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
            return w * h.to(x.dtype)
        g = torch.compile(hf) if impl == "compile" else hf
        f = lambda: g(x, w)
    else:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        f = lambda: LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama")
    fwd = median_us(f)
    y = f()

    def bwd():
        x.grad = w.grad = None
        y.backward(dy, retain_graph=True)
    emit("rms_norm_fwd", f"{M}x{H}", dt, fwd, 2 * M * H * s)
    emit("rms_norm_bwd", f"{M}x{H}", dt, median_us(bwd), 3 * M * H * s)


def rope_case(B, T, Hq, Hk, D, dt):
    s = torch.tensor([], dtype=dt).element_size()
    nb = 2 * B * T * (Hq + Hk) * D * s
    shape = f"{B}x{T}x{Hq}/{Hk}x{D}"
    q = torch.randn(B, T, Hq, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_(True)
    k = torch.randn(B, T, Hk, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_(True)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    fr = torch.outer(torch.arange(T, device=dev).float(), inv)
    emb = torch.cat((fr, fr), dim=-1)
    cos, sin = emb.cos()[None].to(dt), emb.sin()[None].to(dt)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    if impl in ("torch", "compile"):
        def rot_half(x):
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
            return torch.cat((-x2, x1), dim=-1)

        def f0():
            c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
            return q * c + rot_half(q) * sn, k * c + rot_half(k) * sn
        f = torch.compile(f0) if impl == "compile" else f0
    else:
        from liger_kernel.ops.rope import LigerRopeFunction
        f = lambda: LigerRopeFunction.apply(q, k, cos, sin)
    fwd = median_us(f)
    oq, ok = f()

    def bwd():
        q.grad = k.grad = None
        torch.autograd.backward((oq, ok), (dq, dk), retain_graph=True)
    emit("rope_fwd", shape, dt, fwd, nb)
    emit("rope_bwd", shape, dt, median_us(bwd), nb)


def swiglu_case(M, I, dt):
    s = torch.tensor([], dtype=dt).element_size()
    a = torch.randn(M, I, device=dev, dtype=dt, requires_grad=True)
    b = torch.randn(M, I, device=dev, dtype=dt, requires_grad=True)
    dc = torch.randn(M, I, device=dev, dtype=dt)
    if impl in ("torch", "compile"):
        g = lambda a, b: torch.nn.functional.silu(a) * b
        g = torch.compile(g) if impl == "compile" else g
        fwd = median_us(lambda: g(a, b))
        c = g(a, b)

        def bwd():
            a.grad = b.grad = None
            c.backward(dc, retain_graph=True)
        bwd = median_us(bwd)
    else:
        from liger_kernel.ops.swiglu import swiglu_forward, swiglu_backward
        a2, b2 = a.detach(), b.detach()
        fwd = median_us(lambda: swiglu_forward(a2, b2))
        bwd = median_us(lambda: swiglu_backward(a2, b2, dc))
    emit("swiglu_fwd", f"{M}x{I}", dt, fwd, 3 * M * I * s)
    emit("swiglu_bwd", f"{M}x{I}", dt, bwd, 5 * M * I * s)


rms_case(2048, 4096, torch.bfloat16)
rms_case(2048, 4096, torch.float32)
rope_case(1, 1024, 32, 8, 128, torch.bfloat16)
swiglu_case(2048, 14336, torch.bfloat16)
