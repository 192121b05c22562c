"""Times PyTorch's scaled_dot_product_attention (flash and cuDNN backends) and FlexAttention
(torch.compile) on the shapes of `cargo bench --bench attention` (bf16, B=4, Hq=16, Hkv=4,
seq 2048 / 8192, head_dim 128 / 64, causal and not), forward and backward, with CUDA events
(median of 20 after 3 warm-up runs), printing the same CSV columns. GQA through
`enable_gqa=True` (SDPA) and FlexAttention's own GQA; FLOPs as the bench counts them.
`ATTN_SMALL=1` runs seq 2048 only, `ATTN_NO_FLEX=1` skips FlexAttention. The cuDNN backend
is the one SDPA picks by default on Hopper for these shapes (what a PyTorch training step
gets); it takes GQA natively (`enable_gqa=True`), summing dK/dV over each group itself.
First it prints the device's measured bf16 tensor-core peak, the best of cuBLAS's square
bf16 GEMMs (`torch.matmul`, f32 accumulation) at n = 4096, 8192 and 16384, as
`gemm_bf16,n,n,n,ms,TFLOP/s` rows: the yardstick the attention rows are read against."""
import os
import torch
import torch.nn.functional as F

torch.backends.cuda.matmul.allow_tf32 = True
REPS, WARMUP = 20, 3


def time_ms(f):
    for _ in range(WARMUP):
        f()
    ts = []
    for _ in range(REPS):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        f()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    ts.sort()
    return ts[REPS // 2]


def gemm_peak():
    for n in [4096, 8192, 16384]:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        ms = time_ms(lambda: torch.matmul(a, b))
        print(f"gemm_bf16,{n},{n},{n},{ms:.3f},{2 * n ** 3 / ms / 1e9:.1f}")
        del a, b


def main():
    seqs = [2048] if os.environ.get("ATTN_SMALL") else [2048, 8192]
    b, hq, hkv = 4, 16, 4
    try:
        if os.environ.get("ATTN_NO_FLEX"):
            raise RuntimeError("ATTN_NO_FLEX set")
        # The timed backward replays one graph (retain_graph), which donated buffers forbid.
        import torch._functorch.config as functorch_config
        functorch_config.donated_buffer = False
        from torch.nn.attention.flex_attention import flex_attention, create_block_mask
        flex = torch.compile(flex_attention)
    except Exception as e:  # noqa: BLE001
        print(f"# no FlexAttention: {e}")
        flex = None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    print("op,seq,head_dim,causal,ms,TFLOP/s")
    gemm_peak()
    for s in seqs:
        for d in [128, 64]:
            for causal in [True, False]:
                q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                v = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
                c = "causal" if causal else "full"
                # Flash needs repeated k/v for GQA in some builds: repeat outside the timing.
                kr = k.detach().repeat_interleave(hq // hkv, 1).requires_grad_()
                vr = v.detach().repeat_interleave(hq // hkv, 1).requires_grad_()

                def sdpa():
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        return F.scaled_dot_product_attention(q, kr, vr, is_causal=causal)
                o = sdpa()
                do = torch.randn_like(o)
                fwd = time_ms(sdpa)
                bwd = time_ms(lambda: torch.autograd.grad(o, (q, kr, vr), do, retain_graph=True))
                print(f"sdpa_flash_fwd,{s},{d},{c},{fwd:.3f},{flops / fwd / 1e9:.1f}")
                print(f"sdpa_flash_bwd,{s},{d},{c},{bwd:.3f},{2.5 * flops / bwd / 1e9:.1f}")

                def cudnn():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
                try:
                    oc = cudnn()
                    fwd = time_ms(cudnn)
                    bwd = time_ms(lambda: torch.autograd.grad(oc, (q, k, v), do, retain_graph=True))
                    print(f"sdpa_cudnn_fwd,{s},{d},{c},{fwd:.3f},{flops / fwd / 1e9:.1f}")
                    print(f"sdpa_cudnn_bwd,{s},{d},{c},{bwd:.3f},{2.5 * flops / bwd / 1e9:.1f}")
                    del oc
                except Exception as e:  # noqa: BLE001
                    print(f"# cudnn failed: {e}")
                if flex is not None:
                    try:
                        mask = None
                        if causal:
                            mask = create_block_mask(lambda b_, h, qi, ki: qi >= ki, None, None, s, s)
                        fo = flex(q, k, v, block_mask=mask, enable_gqa=True)
                        fwd = time_ms(lambda: flex(q, k, v, block_mask=mask, enable_gqa=True))
                        bwd = time_ms(lambda: torch.autograd.grad(fo, (q, k, v), do, retain_graph=True))
                        print(f"flex_fwd,{s},{d},{c},{fwd:.3f},{flops / fwd / 1e9:.1f}")
                        print(f"flex_bwd,{s},{d},{c},{bwd:.3f},{2.5 * flops / bwd / 1e9:.1f}")
                    except Exception as e:  # noqa: BLE001
                        print(f"# flex failed: {e}")
                del q, k, v, kr, vr, o, do
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
