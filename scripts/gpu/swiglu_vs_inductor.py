"""SwiGLU backward: liger-rs's kernel against torch.compile's (Inductor's Triton kernel) in one
process, on the same PyTorch tensors, timed the same way.

The bench (`cargo bench`) and anchors.py time the two in different processes with different
allocators; this script loads liger-rs's sm_90 PTX through the driver API into PyTorch's
context and launches `swiglu_bwd_vt_{f32,bf16}` with the host's shape for these sizes (one
8-byte vector per thread, 256 threads, one tile per block) on PyTorch's buffers, so only the
kernels differ. Each call is bracketed by its own pair of CUDA events, back to back (10 warm-up,
100 timed, median), as benches/ops.rs does. torch.compile runs as anchors.py runs it (autograd
backward of `silu(a) * b`, fresh gradients each call); liger-rs runs into its own buffers and
into the buffers torch.compile last wrote its gradients to, which separates the kernel from
where its outputs lie.

Usage on the device (the PTX from a build here: target/release/build/liger-rs-*/out/):
    python3 swiglu_vs_inductor.py kernels_sm90.ptx
Prints, per dtype, the largest difference from torch.compile's gradients (relative to
|gradient| + 1, in units of the dtype's epsilon; inf if an element was left unwritten), and
GB/s (5 × elements × size per call) for three interleaved rounds. Inductor's own cubin (from a
fresh Triton cache) is also launched the way ours is, which separates its code from its launch.
With SWIGLU_PROFILE=1 each variant runs three times untimed, for ncu."""
import ctypes
import glob
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import tempfile

# Inductor's kernels land in a fresh Triton cache, where `inductor_kernel` finds their cubins.
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton-cache-")
import torch  # noqa: E402

cu = ctypes.CDLL("libcuda.so.1")
THREADS, VECS, VECTOR_BYTES = 256, 1, 8


def check(result, what):
    if result != 0:
        raise RuntimeError(f"{what}: CUresult {result}")


def load_function(path, name):
    """`name` from a PTX file or a cubin, in PyTorch's context."""
    torch.zeros(1, device="cuda")  # PyTorch's context becomes current on this thread
    module, func = ctypes.c_void_p(), ctypes.c_void_p()
    image = open(path, "rb").read()
    if path.endswith(".ptx"):
        image += b"\0"
    check(cu.cuModuleLoadData(ctypes.byref(module), image), "load")
    check(cu.cuModuleGetFunction(ctypes.byref(func), module, name.encode()), name)
    return func


def raw_launcher(func, grid, threads, smem, args):
    """A `cuLaunchKernel` of `func` with `args` (ctypes values), on PyTorch's current stream."""
    params = (ctypes.c_void_p * len(args))(
        *[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in args])

    def launch():
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(cu.cuLaunchKernel(func, grid, 1, 1, threads, 1, 1, smem, stream, params, None),
              "launch")
    launch.keep_alive = (args, params)
    return launch


def inductor_kernel():
    """The newest Triton kernel in the cache with five data pointers (Inductor's SwiGLU
    backward: three inputs, two outputs): its cubin, name, data-pointer count, parameter
    kinds, elements per block and threads per block."""
    found = []
    for ptx in glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "*.ptx")):
        text = open(ptx).read()
        entry = re.search(r"\.entry\s+(\w+)\(([^)]*)\)", text, re.S)
        kinds = re.findall(r"\.param\s+\.(u64|u32|b64|b32|f32)", entry.group(2))
        data = len(list(itertools.takewhile(lambda k: k in ("u64", "b64"), kinds)))
        if data != 5:
            continue
        base = ptx[:-4]
        meta = json.load(open(base + ".json"))
        ttir = open(base + ".ttir").read()
        block = max(int(e) for e in re.findall(r"tt\.make_range \{end = (\d+)", ttir))
        found.append((os.path.getmtime(ptx), base + ".cubin", entry.group(1), kinds, block,
                      32 * meta["num_warps"], meta.get("shared", 0)))
    if not found:
        raise RuntimeError("no five-pointer Triton kernel in the cache")
    return max(found)[1:]


def inductor_launcher(dc, a, b, da, db, ga, gb):
    """Inductor's own cubin launched like ours. Which data pointer is which operand is found
    by trying every assignment on copies until one reproduces torch.compile's gradients."""
    cubin, name, kinds, block, threads, smem = inductor_kernel()
    func = load_function(cubin, name)
    if os.environ.get("OUT"):  # its PTX and cubin, for the SASS side by side with ours
        for ext in (".ptx", ".cubin", ".ttgir"):
            shutil.copy(cubin[:-6] + ext, os.path.join(os.environ["OUT"], name + ext))
    n = a.numel()
    grid = -(-n // block)
    print(f"  Inductor's {name}: {kinds}, {block} elements per block of {threads} threads, "
          f"{smem} B shared, grid {grid}", flush=True)

    def args_for(ptrs):
        # The element count is the first 32-bit parameter; Triton's scratch pointers are null.
        args = [ctypes.c_uint64(p) for p in ptrs]
        for k in kinds[5:]:
            wide = k in ("u64", "b64")
            args.append(ctypes.c_uint64(0) if wide else ctypes.c_uint32(n if len(args) == 5 else 0))
        return args
    for outs in itertools.combinations(range(5), 2):
        ins = [i for i in range(5) if i not in outs]
        for perm in itertools.permutations((dc, a, b)):
            for pair in ((0, 1), (1, 0)):
                bufs = [t.clone() for t in perm]
                res = [torch.full_like(a, float("nan")) for _ in range(2)]
                ptrs = [0] * 5
                for slot, t in zip(ins, bufs):
                    ptrs[slot] = t.data_ptr()
                for slot, j in zip(outs, pair):
                    ptrs[slot] = res[j].data_ptr()
                raw_launcher(func, grid, threads, smem, args_for(ptrs))()
                torch.cuda.synchronize()
                if torch.equal(res[0], ga) and torch.equal(res[1], gb):
                    live = [0] * 5
                    for slot, t in zip(ins, perm):
                        live[slot] = t.data_ptr()
                    for slot, t in zip(outs, (da, db) if pair == (0, 1) else (db, da)):
                        live[slot] = t.data_ptr()
                    return raw_launcher(func, grid, threads, smem, args_for(live))
    raise RuntimeError(f"no assignment of {name}'s pointers reproduces torch.compile's gradients")


def launcher(func, dc, a, b, da, db):
    """`swiglu_bwd_vt_*(dc, dc_stride, a, a_stride, b, b_stride, da, db, rows, cols, gm, dm)`."""
    rows, cols = a.shape
    lanes = VECTOR_BYTES // a.element_size()
    grid = rows * cols // lanes // (VECS * THREADS)
    u64 = ctypes.c_uint64
    args = [u64(dc.data_ptr()), u64(cols), u64(a.data_ptr()), u64(cols), u64(b.data_ptr()),
            u64(cols), u64(da.data_ptr()), u64(db.data_ptr()), u64(rows), u64(cols),
            ctypes.c_float(1.0), ctypes.c_float(1.0)]
    return raw_launcher(func, grid, THREADS, 0, args)


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
    print(f"{rows}x{cols} {dt}: grid {rows * cols // (VECTOR_BYTES // a.element_size()) // (VECS * THREADS)}"
          f" x {THREADS}; max |liger-rs - torch.compile| / (|torch.compile| + 1) = {err:.2f} eps",
          flush=True)
    into_grads = launcher(func, dc, a.detach(), b.detach(), ga, gb)
    theirs = inductor_launcher(dc, a.detach(), b.detach(), torch.empty_like(a),
                               torch.empty_like(b), ga, gb)
    timed = {"liger-rs, own buffers": ours, "liger-rs, into compile's grads": into_grads,
             "Inductor's cubin, our launch": theirs, "torch.compile": compiled}
    if os.environ.get("SWIGLU_PROFILE"):  # a few calls of each, for ncu
        for fn in timed.values():
            for _ in range(3):
                fn()
        torch.cuda.synchronize()
        return
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
    if not os.environ.get("SWIGLU_PROFILE"):
        case(ptx, 16384, 14336, torch.bfloat16)
