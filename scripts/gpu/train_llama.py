"""PyTorch beside `examples/train_llama/`: the same Llama-style decoder, the same initial
weights and batches (the example's generator reproduced: splitmix64, Box-Muller in f64, the
random-walk task), trained with the same AdamW (lr warm-up, the gradients clipped to a global
norm of 1) in

  eager    HF Llama's eager modules: RMSNorm, rotate-half RoPE, attention as matmul, causal
           mask, f32 softmax, matmul over repeated key/value heads, silu(gate)·up,
           cross-entropy over f32 logits;
  liger    Liger-Kernel 0.8.5's ops as `apply_liger_kernel_to_llama` patches them (RMSNorm,
           RoPE, SwiGLU, fused linear cross-entropy) with SDPA attention;
  compile  the eager model with SDPA attention under torch.compile.
  packed   liger's ops, with the QKV and the gate-up projections each one GEMM over the
           stacked weights, as the example's liger-rs run computes them: the same model and
           arithmetic, other GEMM kernels (not in the default modes; it shows how far a bf16
           curve moves with the GEMMs' kernel choice alone).

Weights are f32 masters cast to --dtype in the forward, as in the example's candle-nn run;
`torch.optim.AdamW(fused=True)`. Each run prints its loss per step; the summary gives the
median step time over steps 2..N (the loss read back; the batches are on the device before the
first step), tokens/s, and peak device memory as the caching allocator's high-water marks
(allocated, and reserved).

  python3 scripts/gpu/train_llama.py [--size small|llama] [--dtype f32|bf16|f16]
      [--modes eager,liger,compile,packed] [--steps N] [--fingerprints]
  NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node N scripts/gpu/train_llama.py ...

Under torchrun each run is data-parallel, PyTorch DDP over N GPUs (NCCL, DDP's 25 MB buckets
overlapped with the backward): rank r trains on rows r·b/N..(r+1)·b/N of each batch, the
losses printed are the means over the ranks, rank 0 prints, and tokens/s counts the whole
batch: the twin of the example's `--ranks N`.

`--fingerprints` prints the weights' and the first batch's fingerprints (needs numpy only)
and exits: they must equal the example's `fingerprints:` line for the same size and seed.
"""
import argparse
import math
import os
import statistics
import sys
import time

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
M1, M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
SUCCESSORS = 4
EPS = 1e-5
CLIP = 1.0

SIZES = {
    "small": dict(layers=4, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab=512,
                  seq=512, batch=8, steps=100),
    "llama": dict(layers=4, hidden=2048, heads=16, kv_heads=4, intermediate=5632, vocab=32000,
                  seq=2048, batch=4, steps=100),
    "cpu": dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=176, vocab=64, seq=64,
                batch=4, steps=30),
}


class Rng:
    """The example's `Rng`: splitmix64 from `seed`, drawn in blocks."""

    def __init__(self, seed):
        self.seed = np.uint64(seed)
        self.count = 0

    def draw(self, n):
        i = np.arange(self.count + 1, self.count + n + 1, dtype=np.uint64)
        self.count += n
        z = self.seed + i * GOLDEN
        z = (z ^ (z >> np.uint64(30))) * M1
        z = (z ^ (z >> np.uint64(27))) * M2
        return z ^ (z >> np.uint64(31))

    def normal(self, n):
        d = self.draw(2 * n)
        unit = lambda x: ((x >> np.uint64(11)).astype(np.float64) + 0.5) / float(1 << 53)
        u, v = unit(d[0::2]), unit(d[1::2])
        return np.sqrt(-2.0 * np.log(u)) * np.cos(math.tau * v)


def initial_weights(c):
    """(name, shape, f32 values) per trainable tensor, in the example's order."""
    rng = Rng(c["seed"])
    normal = lambda name, shape: (name, shape, (0.02 * rng.normal(int(np.prod(shape)))).astype(np.float32))
    ones = lambda name, n: (name, (n,), np.ones(n, dtype=np.float32))
    h, kv = c["hidden"], c["kv_heads"] * (c["hidden"] // c["heads"])
    w = [normal("embed", (c["vocab"], h))]
    for l in range(c["layers"]):
        w += [ones(f"{l}.attn_norm", h), normal(f"{l}.q", (h, h)), normal(f"{l}.k", (kv, h)),
              normal(f"{l}.v", (kv, h)), normal(f"{l}.o", (h, h)), ones(f"{l}.mlp_norm", h),
              normal(f"{l}.gate", (c["intermediate"], h)), normal(f"{l}.up", (c["intermediate"], h)),
              normal(f"{l}.down", (h, c["intermediate"]))]
    return w + [ones("norm", h), normal("head", (c["vocab"], h))]


class Task:
    """The example's task: a walk on a fixed random graph, then a copy of the walk."""

    def __init__(self, vocab, seed):
        rng = Rng(seed ^ 0x7A5C)
        self.successors = (rng.draw(vocab * SUCCESSORS) % np.uint64(vocab)).astype(np.int64)
        self.successors = self.successors.reshape(vocab, SUCCESSORS)
        self.vocab, self.seed = vocab, seed

    def batch(self, c, step):
        """Inputs [batch, seq] and targets [batch·seq] of `step`, int64."""
        mult = (step * 0x517CC1B727220A) % (1 << 64)
        rng = Rng(self.seed ^ mult)
        length = c["seq"] + 1
        half = length // 2
        d = rng.draw(c["batch"] * half).reshape(c["batch"], half)
        tokens = np.zeros((c["batch"], length), dtype=np.int64)
        tokens[:, 0] = (d[:, 0] % np.uint64(self.vocab)).astype(np.int64)
        choice = (d % np.uint64(SUCCESSORS)).astype(np.int64)
        for i in range(1, half):
            tokens[:, i] = self.successors[tokens[:, i - 1], choice[:, i]]
        for i in range(half, length):
            tokens[:, i] = tokens[:, i - half]
        return tokens[:, :-1], tokens[:, 1:].reshape(-1)


def fingerprint(chunks):
    """Σ (2i + 1)·xᵢ modulo 2⁶⁴ over the concatenated chunks (the example's `fingerprint`)."""
    total, offset = 0, 0
    for x in chunks:
        x = np.asarray(x).astype(np.uint64)
        idx = np.arange(offset, offset + x.size, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
        total = (total + int(np.sum(x.reshape(-1) * idx, dtype=np.uint64))) % (1 << 64)
        offset += x.size
    return total


def print_fingerprints(c, init, task):
    inputs, _ = task.batch(c, 0)
    weights = fingerprint(v.view(np.uint32) for _, _, v in init)
    print(f"fingerprints: weights {weights:016x}, first batch {fingerprint([inputs]):016x}")


def run(mode, c, init, task, dtype):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    ranks = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if ranks > 1 else 0
    dev = f"cuda:{torch.cuda.current_device()}"
    b, t, hq, hk = c["batch"] // ranks, c["seq"], c["heads"], c["kv_heads"]
    d, hidden = c["hidden"] // hq, c["hidden"]
    params = [torch.nn.Parameter(torch.tensor(v.reshape(shape), device=dev)) for _, shape, v in init]
    inv_freq = np.float32(1.0) / np.power(np.float32(10000.0),
                                          np.arange(0, d // 2, dtype=np.float32) * np.float32(2.0) / np.float32(d))
    freqs = torch.arange(t, device=dev, dtype=torch.float32)[:, None] * torch.tensor(inv_freq, device=dev)[None, :]
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(dtype)
    sin = torch.cat([freqs.sin(), freqs.sin()], -1).to(dtype)
    mask = torch.full((t, t), float("-inf"), device=dev).triu(1)

    liger = mode in ("liger", "packed")
    if liger:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        flce = LigerFusedLinearCrossEntropyLoss()

    def rms(x, w):
        if liger:
            return LigerRMSNormFunction.apply(x, w, EPS)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        return w * xf.to(x.dtype)

    def rotate_half(x):
        return torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)

    def attention(q, k, v):
        if mode == "eager":
            n = hq // hk
            k, v = k.repeat_interleave(n, 1), v.repeat_interleave(n, 1)
            s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(d))
            p = torch.softmax(s.float() + mask, -1).to(q.dtype)
            return p @ v
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def loss_fn(inputs, targets):
        w = [p.to(dtype) for p in params]
        x = F.embedding(inputs, w[0])
        for l in range(c["layers"]):
            an, wq, wk, wv, wo, mn, wg, wu, wd = w[1 + 9 * l: 10 + 9 * l]
            h = rms(x, an)
            if mode == "packed":
                q, k, v = (h @ torch.cat([wq, wk, wv]).T).split([hidden, hk * d, hk * d], -1)
            else:
                q, k, v = h @ wq.T, h @ wk.T, h @ wv.T
            q = q.reshape(b, t, hq, d).transpose(1, 2)
            k = k.reshape(b, t, hk, d).transpose(1, 2)
            v = v.reshape(b, t, hk, d).transpose(1, 2)
            if liger:
                q, k = liger_rotary_pos_emb(q, k, cos[None], sin[None])
            else:
                q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
            a = attention(q, k, v).transpose(1, 2).reshape(b, t, hidden)
            x = x + a @ wo.T
            h = rms(x, mn)
            if mode == "packed":
                gate, up = (h @ torch.cat([wg, wu]).T).chunk(2, -1)
            else:
                gate, up = h @ wg.T, h @ wu.T
            m = LigerSiLUMulFunction.apply(gate, up) if liger else F.silu(gate) * up
            x = x + m @ wd.T
        h = rms(x, w[-2]).reshape(b * t, hidden)
        if liger:
            return flce(w[-1], h, targets).float()
        return F.cross_entropy((h @ w[-1].T).float(), targets)

    step_loss = torch.compile(loss_fn) if mode == "compile" else loss_fn
    if ranks > 1:
        inner = step_loss

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.weights = torch.nn.ParameterList(params)

            def forward(self, inputs, targets):
                return inner(inputs, targets)

        step_loss = torch.nn.parallel.DistributedDataParallel(Net(), device_ids=[torch.cuda.current_device()])
    opt = torch.optim.AdamW(params, lr=c["lr"], betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01,
                            fused=True)
    # Every step's batch on the device before the clock starts (the walk is a Python loop).
    batches = []
    for step in range(c["steps"]):
        inputs, targets = task.batch(c, step)
        inputs, targets = inputs[rank * b:(rank + 1) * b], targets[rank * b * t:(rank + 1) * b * t]
        batches.append((torch.from_numpy(np.ascontiguousarray(inputs)).to(dev),
                        torch.from_numpy(np.ascontiguousarray(targets)).to(dev)))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for step, (inputs, targets) in enumerate(batches):
        start = time.perf_counter()
        for g in opt.param_groups:
            g["lr"] = c["lr"] * min(1.0, (step + 1) / max(c["warmup"], 1))
        loss = step_loss(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ranks > 1:
            loss = loss.detach().clone()
            dist.all_reduce(loss)
            loss /= ranks
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return dict(name=mode, losses=losses, times=times,
                allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--modes", default="eager,liger,compile")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--fingerprints", action="store_true")
    a = ap.parse_args()
    modes = a.modes.split(",")
    unknown = [m for m in modes if m not in ("eager", "liger", "compile", "packed")]
    if unknown:
        ap.error(f"--modes: {', '.join(unknown)}: eager, liger, compile or packed")
    c = dict(SIZES[a.size], warmup=a.warmup, lr=a.lr, seed=a.seed)
    if a.steps is not None:
        c["steps"] = a.steps
    init = initial_weights(c)
    task = Task(c["vocab"], c["seed"])
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"{c}; {sum(v.size for _, _, v in init) / 1e6:.1f} M parameters")
        print_fingerprints(c, init, task)
    if a.fingerprints:
        return
    import torch
    import torch.distributed as dist
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if ranks > 1:
        if c["batch"] % ranks:
            sys.exit(f"{ranks} ranks must divide the batch of {c['batch']}")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    runs = []
    for mode in modes:
        runs.append(run(mode, c, init, task, dtype))
        torch.cuda.empty_cache()
    if ranks > 1:
        dist.destroy_process_group()
        if int(os.environ["RANK"]) > 0:
            return
        print(f"{ranks} ranks (DDP), {c['batch'] // ranks} rows each; peak memory of rank 0")
    print("step  " + "  ".join(f"{r['name']:>10}" for r in runs))
    for i in range(c["steps"]):
        print(f"{i + 1:>4}  " + "  ".join(f"{r['losses'][i]:>10.6f}" for r in runs))
    print(f"\n{'run':>8} {'first step (s)':>15} {'step (ms)':>10} {'tokens/s':>10} "
          f"{'peak allocated':>15} {'peak reserved':>14} {'final loss':>11}")
    tokens = c["batch"] * c["seq"]
    for r in runs:
        ms = 1e3 * statistics.median(r["times"][1:] or r["times"])
        print(f"{r['name']:>8} {r['times'][0]:>15.2f} {ms:>10.2f} {tokens / ms * 1e3:>10.0f} "
              f"{r['allocated'] / 2**20:>11.0f} MiB {r['reserved'] / 2**20:>10.0f} MiB "
              f"{r['losses'][-1]:>11.4f}")


if __name__ == "__main__":
    sys.exit(main())
