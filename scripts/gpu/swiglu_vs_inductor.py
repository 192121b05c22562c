"""SwiGLU backward: liger-rs's kernel against torch.compile's (Inductor's Triton kernel) in one
process, on the same PyTorch tensors, timed the same way.

The bench (`cargo bench`) and anchors.py time the two in different processes with different
allocators; this script loads liger-rs's sm_90 PTX through the driver API into PyTorch's
context and launches `swiglu_bwd_vt_{f32,bf16}` with the host's shape for these sizes (two
16-byte vectors per thread, 256 threads, one tile per block) on PyTorch's buffers, so only the
kernels differ. Each call is bracketed by its own pair of CUDA events, back to back (10 warm-up,
100 timed, median), as benches/ops.rs does. torch.compile runs as anchors.py runs it (autograd
backward of `silu(a) * b`, fresh gradients each call); liger-rs runs into its own buffers and
into the buffers torch.compile last wrote its gradients to, which separates the kernel from
where its outputs lie.

Usage on the device (the PTX from a build here: target/release/build/liger-rs-*/out/):
    python3 swiglu_vs_inductor.py kernels_sm90.ptx
Prints, per dtype, the largest difference from torch.compile's gradients (relative to
|gradient| + 1, in units of the dtype's epsilon; inf if an element was left unwritten), and
GB/s (5 × elements × size per call) for three interleaved rounds."""
import ctypes
import statistics
import sys

import torch

cu = ctypes.CDLL("libcuda.so.1")
THREADS, VECS = 256, 2


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what}: CUresult {result}")


def load_function(ptx_path, name):
    torch.zeros(1, device="cuda")  # PyTorch's context becomes current on this thread
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    check(cu.cuModuleLoadData(ctypes.byref(module), open(ptx_path, "rb").read() + b"\0"), "load")
    check(cu.cuModuleGetFunction(ctypes.byref(func), module, name.encode()), name)
    return func


def launcher(func, dc, a, b, da, db):
    """`swiglu_bwd_vt_*(dc, dc_stride, a, a_stride, b, b_stride, da, db, rows, cols, gm, dm)`."""
    rows, cols = a.shape
    lanes = 16 // a.element_size()
    grid = rows * cols // lanes // (VECS * THREADS)
    u64 = ctypes.c_uint64
    args = [u64(dc.data_ptr()), u64(cols), u64(a.data_ptr()), u64(cols), u64(b.data_ptr()),
            u64(cols), u64(da.data_ptr()), u64(db.data_ptr()), u64(rows), u64(cols),
            ctypes.c_float(1.0), ctypes.c_float(1.0)]
    params = (ctypes.c_void_p * len(args))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in args])

    def launch():
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(cu.cuLaunchKernel(func, grid, 1, 1, THREADS, 1, 1, 0, stream, params, None), "launch")
    launch.keep_alive = (args, params)
    return launch


def median_ms(fn, warmup=10, reps=100):
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def case(ptx_path, rows, cols, dt, rounds=3):
    name = {torch.float32: "swiglu_bwd_vt_f32", torch.bfloat16: "swiglu_bwd_vt_bf16"}[dt]
    func = load_function(ptx_path, name)
    a = torch.randn(rows, cols, device="cuda", dtype=dt, requires_grad=True)
    b = torch.randn(rows, cols, device="cuda", dtype=dt, requires_grad=True)
    dc = torch.randn(rows, cols, device="cuda", dtype=dt)
    c = torch.compile(lambda a, b: torch.nn.functional.silu(a) * b)(a, b)

    def compiled():
        a.grad = None
        b.grad = None
        c.backward(dc, retain_graph=True)
    compiled()
    ga, gb = a.grad, b.grad  # held: later compiled() calls write elsewhere
    da, db = torch.empty_like(a), torch.empty_like(b)
    ours = launcher(func, dc, a.detach(), b.detach(), da, db)
    da.fill_(float("nan"))
    db.fill_(float("nan"))
    ours()
    torch.cuda.synchronize()
    eps = torch.finfo(dt).eps
    err = max(((mine - ref).abs() / (ref.abs() + 1)).nan_to_num(float("inf")).max().item() / eps
              for mine, ref in ((da, ga), (db, gb)))
    print(f"{rows}x{cols} {dt}: grid {rows * cols // (16 // a.element_size()) // (VECS * THREADS)}"
          f" x {THREADS}; max |liger-rs - torch.compile| / (|torch.compile| + 1) = {err:.2f} eps",
          flush=True)
    into_grads = launcher(func, dc, a.detach(), b.detach(), ga, gb)
    timed = {"liger-rs, own buffers": ours, "liger-rs, into compile's grads": into_grads,
             "torch.compile": compiled}
    gbps = {k: [] for k in timed}
    nbytes = 5 * a.numel() * a.element_size()
    for _ in range(rounds):
        for label, fn in timed.items():
            gbps[label].append(nbytes / median_ms(fn) / 1e6)
    for label, values in gbps.items():
        print(f"  {label:32s} " + " / ".join(f"{v:.0f}" for v in values) + " GB/s", flush=True)


if __name__ == "__main__":
    ptx = sys.argv[1]
    case(ptx, 16384, 8192, torch.float32)
    case(ptx, 16384, 14336, torch.bfloat16)
