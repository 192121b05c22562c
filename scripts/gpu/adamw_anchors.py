"""PyTorch beside `cargo bench --bench adamw`: one `torch.optim.AdamW` step (fused=True and
foreach=True) over the bench's two lists of tensors (f32 parameters and gradients; CUDA events,
median of 20 samples of 5 steps back to back, after 3 warm-up steps).

`--write-cases DIR` instead saves, for one f32 tensor of 100003 elements and each case (AdamW
and Adam, amsgrad, maximize; SGD plain, with momentum and dampening, Nesterov, maximize), the
initial parameters, 30 gradients and PyTorch's fused parameters and states after each step,
for `adamw -- --torch-cases DIR` to compare bit for bit. `--pow-check` counts the steps where
CUDA's f32 pow differs from the exact power rounded to f32."""
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
        for _ in range(5):
            f()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 5)
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
    steps = 30
    # name optimizer lr beta1 beta2 eps weight_decay amsgrad maximize
    cases = [("default", "adamw", 1e-3, 0.9, 0.999, 1e-8, 0.01, 0, 0),
             ("amsgrad", "adamw", 3e-4, 0.8, 0.95, 1e-6, 0.1, 1, 0),
             ("maximize", "adamw", 1e-2, 0.9, 0.99, 1e-8, 0.0, 0, 1),
             ("adam_l2", "adam", 1e-3, 0.9, 0.999, 1e-8, 0.05, 1, 0)]
    with open(f"{d}/cases.txt", "w") as meta:
        for name, kind, lr, b1, b2, eps, wd, ams, mx in cases:
            meta.write(f"{name} {n} {steps} {kind} {lr} {b1} {b2} {eps} {wd} {ams} {mx}\n")
            p = torch.randn(n, device=dev)
            p.cpu().numpy().tofile(f"{d}/{name}.param0")
            p.requires_grad_()
            cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
            opt = cls([p], lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, amsgrad=bool(ams),
                      maximize=bool(mx), fused=True)
            for t in range(1, steps + 1):
                g = torch.randn(n, device=dev) * 0.1
                g.cpu().numpy().tofile(f"{d}/{name}.grad{t}")
                p.grad = g
                opt.step()
                st = opt.state[p]
                p.detach().cpu().numpy().tofile(f"{d}/{name}.param{t}")
                st["exp_avg"].cpu().numpy().tofile(f"{d}/{name}.m{t}")
                st["exp_avg_sq"].cpu().numpy().tofile(f"{d}/{name}.v{t}")
        # name lr momentum dampening weight_decay nesterov maximize
        sgd = [("sgd_plain", 0.1, 0.0, 0.0, 0.0, 0, 0),
               ("sgd_momentum", 0.05, 0.9, 0.1, 1e-4, 0, 0),
               ("sgd_nesterov", 0.01, 0.95, 0.0, 0.01, 1, 0),
               ("sgd_maximize", 0.1, 0.5, 0.0, 0.0, 0, 1)]
        for name, lr, mom, damp, wd, nest, mx in sgd:
            meta.write(f"{name} {n} {steps} sgd {lr} {mom} {damp} {wd} {nest} {mx}\n")
            p = torch.randn(n, device=dev)
            p.cpu().numpy().tofile(f"{d}/{name}.param0")
            p.requires_grad_()
            opt = torch.optim.SGD([p], lr=lr, momentum=mom, dampening=damp, weight_decay=wd,
                                  nesterov=bool(nest), maximize=bool(mx), fused=True)
            for t in range(1, steps + 1):
                g = torch.randn(n, device=dev) * 0.1
                g.cpu().numpy().tofile(f"{d}/{name}.grad{t}")
                p.grad = g
                opt.step()
                p.detach().cpu().numpy().tofile(f"{d}/{name}.param{t}")
                if mom != 0:
                    opt.state[p]["momentum_buffer"].cpu().numpy().tofile(f"{d}/{name}.m{t}")
    print(f"wrote {len(cases) + len(sgd)} cases to {d}")


def pow_check():
    """How often CUDA's f32 `pow(beta, t)` (the bias corrections' power in PyTorch's fused
    AdamW) differs from the exact power rounded to f32, for common betas and t up to 10^6."""
    t = torch.arange(1, 1_000_001, device=dev, dtype=torch.float32)
    for beta in [0.9, 0.95, 0.98, 0.99, 0.999, 0.9999, 0.8]:
        b32 = torch.tensor(beta, dtype=torch.float32).item()
        got = torch.pow(torch.full_like(t, b32), t)
        exact = torch.pow(torch.tensor(b32, dtype=torch.float64, device=dev), t.double()).float()
        differ = (got.view(torch.int32) != exact.view(torch.int32)).nonzero()
        first = [i + 1 for i in differ[:3, 0].tolist()]
        print(f"pow({beta}, t): {differ.numel()} of 10^6 steps differ; first t: {first}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--write-cases":
        write_cases(sys.argv[2])
    elif len(sys.argv) > 1 and sys.argv[1] == "--pow-check":
        pow_check()
    else:
        bench()
