"""Liger-Kernel 0.8.5 (`liger`) and PyTorch eager (`torch`: HuggingFace's formulas) on the
`cargo bench` rows (benches/ops.rs) that the shared large-shape anchors (RMSNorm, NeoX RoPE,
SwiGLU) do not cover, on the same shapes and dtypes, printed with the bench's op and shape
strings; `compile` is torch.compile of the `torch` function (GEGLU rows only):

  fused_add_fwd/_bwd  bf16 16384x4096, 16384x2048. Liger: LigerFusedAddRMSNormFunction (llama
      casting, a weight with dW). torch: x + r, then HF's RMSNorm.
  geglu_fwd/_bwd  bf16 16384x14336, f32 16384x8192. Liger: geglu_forward / geglu_backward
      (tanh GELU, the only form Liger has), called directly as the anchors call
      swiglu_forward / swiglu_backward. torch: gelu(a, approximate="tanh") * b.
  geglu_erf_fwd/_bwd  the same shapes, the exact GELU: gelu(a) * b (torch and compile only:
      Liger has no exact form).
  rope_i_fwd/_bwd  bf16, f32 4x4096x32/8x128 (B x S x q heads / kv heads x head dim).
      Liger: LigerLlama4RopeFunction, interleaved pairs, q and k [B, S, H, d], freqs_cis
      complex64 [S, d/2]. torch: HF Llama4's apply_rotary_emb.
  rope_qkv_fwd/_bwd  bf16, f32 4x4096x32/8x128. q and k are views into one fused QKV
      projection output [B, S, (32 + 2*8)*128], transposed to [B, H, S, d] as HF does; the
      gradients are views into a buffer of the same layout. Liger: LigerRopeFunction, whose
      rope_forward / rope_backward call .contiguous() on q and k (back in [B, S, H, d]), so
      the views are copied into new tensors that are rotated and returned (nothing is written
      back into the buffer): the times include those copies. torch: HF's rotate_half formula
      on the views.
  mrope_fwd/_bwd  bf16, f32 4x4096x32/8x128. Liger: LigerQwen2VLMRopeFunction, q and k
      [B, H, S, d] (transposes of [B, S, H, d]), cos/sin [3, B, S, d], mrope_section
      [16, 24, 24]. torch: HF Qwen2-VL's apply_multimodal_rotary_pos_emb.

The RoPE backward rows (and the fused add's) run autograd's backward through the forward, as
the shared anchors' rope rows do, so they include what autograd does with the returned
gradients (a copy into q.grad and k.grad).

Timing, as triton's do_bench times (L2 flushed, median) but with an untimed setup step: each
call comes after its setup (clearing .grad; restoring the inputs that Liger's GEGLU backward
overwrites with dA and dB) and after zeroing a 256 MB buffer, between its own pair of CUDA
events; 10 warm-up calls, then the median of 100.

Usage on a GPU machine with torch and triton (Liger-Kernel 0.8.5 for `liger`), in the same
device call as `cargo bench` so that both see the same GPU:
    python3 -m pip install -q --no-deps --target /tmp/liger liger-kernel==0.8.5
    PYTHONPATH=/tmp/liger python3 scripts/gpu/liger_anchors.py liger|torch|compile [OPS]
OPS is a comma-separated subset of fused_add, geglu, geglu_erf, rope_i, rope_qkv, mrope
(default: all that the impl has).
Prints CSV rows: impl, op, shape, dtype, median µs, GB/s on the minimum bytes each op must
move, as `cargo bench` counts them: fused add forward reads x, r and writes s, y, backward
reads dY, dS, S and writes dX (4·M·N·s each); GEGLU forward 3·M·N·s, backward 5·M·N·s; RoPE
q and k read and written once, 2·(|q| + |k|)·s (cos/sin tables and the v part of the QKV
buffer not counted)."""
import sys

import torch

IMPL_OPS = {
    "liger": ("fused_add", "geglu", "rope_i", "rope_qkv", "mrope"),
    "torch": ("fused_add", "geglu", "geglu_erf", "rope_i", "rope_qkv", "mrope"),
    "compile": ("geglu", "geglu_erf"),
}
dev = "cuda"
impl = sys.argv[1] if len(sys.argv) > 1 else "liger"
if impl not in IMPL_OPS:
    sys.exit(__doc__)
ops = sys.argv[2].split(",") if len(sys.argv) > 2 else IMPL_OPS[impl]
if not set(ops) <= set(IMPL_OPS[impl]):
    sys.exit(__doc__)
WARMUP, REPS = 10, 100
EPS = 1e-6
LLAMA = (4, 4096, 32, 8, 128)
MROPE_SECTION = [16, 24, 24]


def median_us(fn, setup=lambda: None):
    """Median µs of `fn` over REPS calls, each after `setup` and an L2 flush (untimed)."""
    for _ in range(WARMUP):
        setup()
        fn()
    pairs = []
    for _ in range(REPS):
        setup()
        flush.zero_()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        pairs.append((s, e))
    torch.cuda.synchronize()
    return sorted(s.elapsed_time(e) for s, e in pairs)[REPS // 2] * 1e3


def no_grads(*tensors):
    def setup():
        for t in tensors:
            t.grad = None
    return setup


def emit(op, shape, dt, us, nbytes):
    print(f"{impl},{op},{shape},{str(dt).replace('torch.', '')},{us:.2f},{nbytes / us / 1e3:.0f}",
          flush=True)


def fused_add_case(M, H, dt):
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
    bwd = median_us(lambda: torch.autograd.backward((y, s_out), (dy, ds), retain_graph=True),
                    no_grads(x, r, w))
    shape = f"{M}x{H}"
    emit("fused_add_fwd", shape, dt, fwd, 4 * M * H * s)
    emit("fused_add_bwd", shape, dt, bwd, 4 * M * H * s)


def geglu_case(M, N, dt, approximate="tanh"):
    s = torch.tensor([], dtype=dt).element_size()
    a = torch.randn(M, N, device=dev, dtype=dt)
    b = torch.randn(M, N, device=dev, dtype=dt)
    dc = torch.randn(M, N, device=dev, dtype=dt)
    if impl == "liger":
        from liger_kernel.ops.geglu import geglu_backward, geglu_forward
        a0, b0 = a.clone(), b.clone()

        # geglu_backward writes dA over a and dB over b: each call gets the same inputs back.
        def restore():
            a.copy_(a0)
            b.copy_(b0)
        fwd = median_us(lambda: geglu_forward(a, b))
        bwd = median_us(lambda: geglu_backward(a, b, dc), restore)
    else:
        a.requires_grad_(True)
        b.requires_grad_(True)
        g = lambda: torch.nn.functional.gelu(a, approximate=approximate) * b
        if impl == "compile":
            g = torch.compile(g)
        fwd = median_us(g)
        c = g()
        bwd = median_us(lambda: c.backward(dc, retain_graph=True), no_grads(a, b))
    shape, op = f"{M}x{N}", "geglu" if approximate == "tanh" else "geglu_erf"
    emit(f"{op}_fwd", shape, dt, fwd, 3 * M * N * s)
    emit(f"{op}_bwd", shape, dt, bwd, 5 * M * N * s)


def angles(S, D):
    """[S, D/2] rotation angles of positions 0..S-1, base 10000, as HF's rotary embeddings."""
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev).float() / D))
    return torch.outer(torch.arange(S, device=dev).float(), inv)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_rows(op, f, q, k, dq, dk, shape, dt):
    """Times `f` (q, k -> rotated q, k) and autograd's backward through it with gradients
    dq, dk."""
    fwd = median_us(f)
    outs = f()
    bwd = median_us(lambda: torch.autograd.backward(outs, (dq, dk), retain_graph=True),
                    no_grads(q, k))
    nbytes = 2 * (q.numel() + k.numel()) * q.element_size()
    emit(f"{op}_fwd", shape, dt, fwd, nbytes)
    emit(f"{op}_bwd", shape, dt, bwd, nbytes)


def rope_i_case(B, S, Hq, Hk, D, dt):
    q = torch.randn(B, S, Hq, D, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(B, S, Hk, D, device=dev, dtype=dt, requires_grad=True)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    fr = angles(S, D)
    freqs_cis = torch.polar(torch.ones_like(fr), fr)
    if impl == "liger":
        from liger_kernel.ops.llama4_rope import LigerLlama4RopeFunction
        f = lambda: LigerLlama4RopeFunction.apply(q, k, freqs_cis)
    else:
        def rotate(x):
            xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
            return torch.view_as_real(xc * freqs_cis[None, :, None, :]).flatten(3).type_as(x)
        f = lambda: (rotate(q), rotate(k))
    rope_rows("rope_i", f, q, k, dq, dk, f"{B}x{S}x{Hq}/{Hk}x{D}", dt)


def rope_qkv_case(B, S, Hq, Hk, D, dt):
    H = Hq + 2 * Hk

    def q_k_views(qkv):
        heads = qkv.view(B, S, H, D)
        return heads[:, :, :Hq].transpose(1, 2), heads[:, :, Hq:Hq + Hk].transpose(1, 2)
    q, k = (t.requires_grad_(True)
            for t in q_k_views(torch.randn(B, S, H * D, device=dev, dtype=dt)))
    dq, dk = q_k_views(torch.randn(B, S, H * D, device=dev, dtype=dt))
    fr = angles(S, D)
    emb = torch.cat((fr, fr), dim=-1)
    cos, sin = emb.cos()[None].to(dt), emb.sin()[None].to(dt)
    if impl == "liger":
        from liger_kernel.ops.rope import LigerRopeFunction
        f = lambda: LigerRopeFunction.apply(q, k, cos, sin)
    else:
        def f():
            c, sn = cos.unsqueeze(1), sin.unsqueeze(1)
            return q * c + rotate_half(q) * sn, k * c + rotate_half(k) * sn
    rope_rows("rope_qkv", f, q, k, dq, dk, f"{B}x{S}x{Hq}/{Hk}x{D}", dt)


def mrope_case(B, S, Hq, Hk, D, dt):
    q = torch.randn(B, S, Hq, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_(True)
    k = torch.randn(B, S, Hk, D, device=dev, dtype=dt).transpose(1, 2).requires_grad_(True)
    dq, dk = torch.randn_like(q), torch.randn_like(k)
    # Text positions, the three tables equal: the values do not change the time.
    fr = angles(S, D)
    emb = torch.cat((fr, fr), dim=-1)
    cos = emb.cos().to(dt).expand(3, B, S, D).contiguous()
    sin = emb.sin().to(dt).expand(3, B, S, D).contiguous()
    if impl == "liger":
        from liger_kernel.ops.qwen2vl_mrope import LigerQwen2VLMRopeFunction
        f = lambda: LigerQwen2VLMRopeFunction.apply(q, k, cos, sin, MROPE_SECTION)
    else:
        def merge(t):
            parts = t.split(MROPE_SECTION * 2, dim=-1)
            return torch.cat([m[i % 3] for i, m in enumerate(parts)], dim=-1).unsqueeze(1)

        def f():
            c, sn = merge(cos), merge(sin)
            return q * c + rotate_half(q) * sn, k * c + rotate_half(k) * sn
    rope_rows("mrope", f, q, k, dq, dk, f"{B}x{S}x{Hq}/{Hk}x{D}", dt)


flush = torch.empty(256 * 2**20, dtype=torch.int8, device=dev)
print("impl,op,shape,dtype,median_us,gbps", flush=True)
if "fused_add" in ops:
    for H in (4096, 2048):
        fused_add_case(16384, H, torch.bfloat16)
for op, approximate in (("geglu", "tanh"), ("geglu_erf", "none")):
    if op in ops:
        geglu_case(16384, 14336, torch.bfloat16, approximate)
        geglu_case(16384, 8192, torch.float32, approximate)
for op, case in (("rope_i", rope_i_case), ("rope_qkv", rope_qkv_case), ("mrope", mrope_case)):
    if op in ops:
        for dt in (torch.bfloat16, torch.float32):
            case(*LLAMA, dt)
