"""PyTorch beside `cargo bench --bench adamw`: one `torch.optim.AdamW` step (fused=True and
foreach=True) over the bench's two lists of tensors (f32 parameters and gradients; CUDA events,
median of 20 after 3 warm-up steps). `--write-cases DIR` instead saves, for one f32 tensor of
100003 elements, the initial parameters, five gradients and PyTorch fused AdamW's parameters
and moments after each step, for `adamw -- --torch-cases DIR` to compare bit for bit."""
import os
import sys
import torch

dev = "cuda"


def shapes(layers, h, kv, inter, vocab):
    v = [vocab * h]
    for _ in range(layers):
        v += [h, h * h, kv * h, kv * h, h * h, h, inter * h, inter * h, h * inter]
    return v + [h, vocab * h]


def time_ms(f):
    for _ in range(3):
        f()
    ts = []
    for _ in range(20):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        f()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e))
    return sorted(ts)[10]


def bench():
    print("impl,list,params,ms,GB/s")
    for name, lens in [("example_46M", shapes(4, 1024, 256, 2816, 512)),
                       ("llama_1B", shapes(16, 2048, 512, 5632, 32000))]:
        n = sum(lens)
        for mode in ["fused", "foreach"]:
            params = [torch.zeros(l, device=dev, requires_grad=True) for l in lens]
            for p in params:
                p.grad = torch.randn_like(p) * 0.01
            opt = torch.optim.AdamW(params, lr=1e-4, **{mode: True})
            ms = time_ms(opt.step)
            print(f"torch-{mode},{name},{n},{ms:.3f},{28 * n / ms / 1e6:.0f}")
            del opt, params
            torch.cuda.empty_cache()


def write_cases(d):
    os.makedirs(d, exist_ok=True)
    torch.manual_seed(3)
    n = 100003
    # name lr beta1 beta2 eps weight_decay amsgrad
    cases = [("default", 1e-3, 0.9, 0.999, 1e-8, 0.01, 0), ("amsgrad", 3e-4, 0.8, 0.95, 1e-6, 0.1, 1)]
    with open(f"{d}/cases.txt", "w") as meta:
        for name, lr, b1, b2, eps, wd, ams in cases:
            meta.write(f"{name} {n} {lr} {b1} {b2} {eps} {wd} {ams}\n")
            p = torch.randn(n, device=dev)
            p.cpu().numpy().tofile(f"{d}/{name}.param0")
            p.requires_grad_()
            opt = torch.optim.AdamW([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd,
                                    amsgrad=bool(ams), fused=True)
            for t in range(1, 6):
                g = torch.randn(n, device=dev) * 0.1
                g.cpu().numpy().tofile(f"{d}/{name}.grad{t}")
                p.grad = g
                opt.step()
                st = opt.state[p]
                p.detach().cpu().numpy().tofile(f"{d}/{name}.param{t}")
                st["exp_avg"].cpu().numpy().tofile(f"{d}/{name}.m{t}")
                st["exp_avg_sq"].cpu().numpy().tofile(f"{d}/{name}.v{t}")
    print(f"wrote {len(cases)} cases to {d}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--write-cases":
        write_cases(sys.argv[2])
    else:
        bench()
