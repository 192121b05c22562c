"""PyTorch and Liger-Kernel beside `cargo bench --bench cross_entropy` (bf16, CUDA events,
median of 20 after 3 warm-up runs):
- cross-entropy over 8192 x 32000 and 8192 x 128256 logits, forward + backward
  (`F.cross_entropy`, `LigerCrossEntropyLoss`), and a copy of the logits;
- fused linear cross-entropy at 8192 tokens x hidden 4096 x vocab 128256: PyTorch's
  `linear` + `cross_entropy` (logits upcast to f32, as HF's Llama does) and
  `LigerFusedLinearCrossEntropyLoss`, time and peak device memory beyond the inputs (with and
  without the gradients, which are outputs).
`--write-cases DIR` instead saves inputs and both libraries' losses and gradients for
`cross_entropy -- --torch-cases DIR` to compare against. Liger must be importable (PYTHONPATH)."""
import os
import sys
import torch
import torch.nn.functional as F

REPS, WARMUP = 20, 3
dev = "cuda"


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


def liger():
    try:
        from liger_kernel.transformers.cross_entropy import LigerCrossEntropyLoss
        from liger_kernel.transformers.fused_linear_cross_entropy import (
            LigerFusedLinearCrossEntropyLoss,
        )
        return LigerCrossEntropyLoss, LigerFusedLinearCrossEntropyLoss
    except Exception as e:  # noqa: BLE001
        print(f"# no Liger-Kernel: {e}")
        return None, None


def ce_rows():
    ce_liger, _ = liger()
    print("impl,op,rows,vocab,ms,GB/s")
    for vocab in [32000, 128256]:
        rows = 8192
        z = (torch.rand(rows, vocab, device=dev) * 8 - 4).to(torch.bfloat16)
        t = torch.randint(0, vocab, (rows,), device=dev)
        nbytes = z.numel() * 2
        copy = time_ms(lambda: z.clone())
        print(f"copy,clone,{rows},{vocab},{copy:.4f},{2 * nbytes / copy / 1e6:.0f}")
        zg = z.clone().requires_grad_()

        def torch_fb():
            zg.grad = None
            F.cross_entropy(zg, t).backward()
        ms = time_ms(torch_fb)
        print(f"torch,ce_fwd_bwd,{rows},{vocab},{ms:.4f},{2 * nbytes / ms / 1e6:.0f}")
        ms = time_ms(lambda: F.cross_entropy(z, t))
        print(f"torch,ce_fwd,{rows},{vocab},{ms:.4f},{nbytes / ms / 1e6:.0f}")
        if ce_liger is not None:
            loss_fn = ce_liger()
            zl = z.clone().requires_grad_()

            def liger_fb():
                zl.grad = None
                loss_fn(zl, t).backward()
            ms = time_ms(liger_fb)
            print(f"liger,ce_fwd_bwd,{rows},{vocab},{ms:.4f},{2 * nbytes / ms / 1e6:.0f}")


def flce():
    _, flce_liger = liger()
    t_, h, v = 8192, 4096, 128256
    torch.manual_seed(0)
    x = torch.randn(t_, h, device=dev, dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, h, device=dev, dtype=torch.bfloat16) * 0.02).requires_grad_()
    tgt = torch.randint(0, v, (t_,), device=dev)
    grads = (x.numel() + w.numel()) * 2

    def torch_step():
        x.grad = w.grad = None
        F.cross_entropy((x @ w.t()).float(), tgt).backward()

    def liger_step():
        x.grad = w.grad = None
        loss_fn(w, x, tgt).backward()

    steps = [("torch", torch_step)]
    if flce_liger is not None:
        loss_fn = flce_liger()
        steps.append(("liger", liger_step))
    print("impl,op,tokens,hidden,vocab,ms,peak_extra_MiB,peak_extra_without_grads_MiB")
    for name, step in steps:
        ms = time_ms(step)
        x.grad = w.grad = None
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        print(f"{name},flce,{t_},{h},{v},{ms:.3f},{peak / 2**20:.1f},{(peak - grads) / 2**20:.1f}")


def write_cases(d):
    ce_liger, _ = liger()
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(1)
    # name rows vocab label_smoothing lse_square_scale softcap(0 = none) ignore_index
    cases = [
        ("plain", 1024, 32000, 0.0, 0.0, 0.0, -100),
        ("smooth", 512, 128256, 0.1, 0.0, 0.0, -100),
        ("zloss_ignore", 512, 32000, 0.0, 1e-4, 0.0, -100),
        ("softcap", 256, 32000, 0.0, 0.0, 30.0, -100),
    ]
    with open(f"{d}/cases.txt", "w") as meta:
        for name, rows, vocab, eps, lam, cap, ign in cases:
            meta.write(f"{name} {rows} {vocab} {eps} {lam} {cap} {ign}\n")
            z = (torch.randn(rows, vocab, device=dev) * 3).to(torch.bfloat16)
            t = torch.randint(0, vocab, (rows,), device=dev)
            if name == "zloss_ignore":
                t[::7] = ign
            z.view(torch.int16).cpu().numpy().tofile(f"{d}/{name}.logits")
            t.cpu().numpy().tofile(f"{d}/{name}.target")
            if lam == 0.0:
                zt = z.float().requires_grad_()
                capped = cap * torch.tanh(zt / cap) if cap > 0 else zt
                loss = F.cross_entropy(capped, t, ignore_index=ign, label_smoothing=eps)
                loss.backward()
                save(d, name, "torch", loss, zt.grad)
            if ce_liger is not None:
                fn = ce_liger(ignore_index=ign, lse_square_scale=lam, label_smoothing=eps,
                              softcap=cap if cap > 0 else None)
                zl = z.clone().requires_grad_()
                loss = fn(zl, t)
                loss.backward()
                save(d, name, "liger", loss, zl.grad)
    write_flce_case(d)
    print(f"wrote {len(cases)} cross-entropy cases and one fused linear case to {d}")


def write_flce_case(d):
    """x [1024, 512], W [32000, 512] (bf16), targets with ignored rows: PyTorch's f32 loss and
    gradients of `cross_entropy((x @ W.t()).float(), t)` and Liger's FLCE's."""
    _, flce_liger = liger()
    torch.manual_seed(2)
    t_, h, v = 1024, 512, 32000
    x = torch.randn(t_, h, device=dev).to(torch.bfloat16)
    w = (torch.randn(v, h, device=dev) / h ** 0.5).to(torch.bfloat16)
    tgt = torch.randint(0, v, (t_,), device=dev)
    tgt[::11] = -100
    with open(f"{d}/flce.txt", "w") as meta:
        meta.write(f"{t_} {h} {v}\n")
    for name, a in [("x", x), ("w", w)]:
        a.view(torch.int16).cpu().numpy().tofile(f"{d}/flce.{name}")
    tgt.cpu().numpy().tofile(f"{d}/flce.target")
    runs = [("torch", lambda xg, wg: F.cross_entropy((xg @ wg.t()).float(), tgt))]
    if flce_liger is not None:
        fn = flce_liger()
        runs.append(("liger", lambda xg, wg: fn(wg, xg, tgt)))
    for imp, f in runs:
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = f(xg, wg)
        loss.backward()
        loss.detach().float().reshape(1).cpu().numpy().tofile(f"{d}/flce.{imp}.loss")
        xg.grad.float().cpu().numpy().tofile(f"{d}/flce.{imp}.dx")
        wg.grad.float().cpu().numpy().tofile(f"{d}/flce.{imp}.dw")


def save(d, name, imp, loss, grad):
    loss.detach().float().reshape(1).cpu().numpy().tofile(f"{d}/{name}.{imp}.loss")
    grad.to(torch.bfloat16).view(torch.int16).cpu().numpy().tofile(f"{d}/{name}.{imp}.grad")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--write-cases":
        write_cases(sys.argv[2])
    else:
        ce_rows()
        flce()
