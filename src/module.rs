//! The embedded PTX, each kernel loaded into a CUDA context on its first use there and cached
//! for the life of the process.
use crate::error::{Error, Result};
use crate::identity::Kernel;
use crate::ptx::Split;
use crate::scratch::ScratchPool;
use cudarc::driver::{CudaContext, CudaFunction, DriverError, sys};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};

/// PTX of every kernel, built from `kernels-gpu` by `build.rs` for sm_80 (JIT-compiled forward
/// by the driver on newer GPUs). Used on devices of compute capability 8.x, and on newer ones
/// where [`PTX_SM90`] is not (see there).
///
/// A context loads each kernel on its first use there, as a module of its own (this build's
/// header and declarations, then the kernel's entry), so the driver JIT-compiles only the
/// kernels that a process launches rather than all of them at its first call.
///
/// ```
/// assert!(liger_rs::PTX.contains(".visible .entry rms_norm_fwd_bf16_llama"));
/// ```
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

/// The same kernels built for sm_90a (Hopper's architecture-specific target, which the driver
/// loads on compute capability 9.0 only). The code is [`PTX`]'s but for the products of the
/// tensor-core attention kernels (forward, dQ and dK/dV), `wgmma.mma_async` of one warpgroup
/// on shared-memory tiles laid out for its 128-byte swizzle (where [`PTX`] has `mma.sync` per
/// warp; the dQ kernel also steps 64 keys at a time, where [`PTX`]'s takes 32 at head_dim
/// 128, and the dK/dV kernel is one warpgroup where [`PTX`]'s is eight warps), and the RMSNorm
/// backward's dW hand-off: the dW reduction starts with `griddepcontrol.wait`, as the host launches it as a
/// programmatic dependent launch after the backward (its launch is processed while the
/// backward runs, and its blocks start as the backward's last blocks exit, then wait there for
/// the backward's partial rows); the f32 backward kernels that keep dW in registers
/// (`rms_norm_bwd_v2_f32_*`) start with `griddepcontrol.launch_dependents`, which lets that
/// launch happen at once; and the backward kernels that keep dW in shared memory
/// (`rms_norm_bwd_vs{1,2}_*`), launched in thread-block clusters of two, merge their blocks'
/// rows into one partial row per cluster through distributed shared memory (`barrier.cluster`,
/// `mapa`, `ld.shared::cluster`; half the partial rows). PERFORMANCE.md ("sm_90: dependent
/// launch and dW clusters") has what each saves.
/// Used on devices of compute capability 9.0 with a driver of CUDA ≥ 12.3, unless the
/// environment variable [`BASELINE_PTX_ENV`] is set; loaded kernel by kernel as [`PTX`] is.
///
/// ```
/// assert!(liger_rs::PTX_SM90.contains("griddepcontrol.wait"));
/// assert!(liger_rs::PTX_SM90.contains("barrier.cluster.wait"));
/// assert!(liger_rs::PTX_SM90.contains("wgmma.mma_async"));
/// assert!(!liger_rs::PTX.contains("griddepcontrol"));
/// assert!(!liger_rs::PTX.contains("wgmma"));
/// assert!(!liger_rs::PTX.contains("cluster"));
/// ```
pub const PTX_SM90: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels_sm90.ptx"));

/// Set (to anything) to use [`PTX`] even where [`PTX_SM90`] would be used, e.g. to test the
/// sm_80 build on a Hopper GPU. Read at a context's first call.
pub const BASELINE_PTX_ENV: &str = "LIGER_RS_BASELINE_PTX";

/// The oldest driver (`cuDriverGetVersion`) [`PTX_SM90`] is used with: CUDA 12.3, the release
/// that brought programmatic edges to graphs (so a captured backward keeps its early start).
const SM90_MIN_DRIVER: i32 = 12030;

/// This thread in relaxed stream-capture mode until dropped (then back to its own mode), so
/// that a kernel's first load may happen while a stream is captured into a graph: under a
/// global or thread-local capture, CUDA refuses module loads as potentially unsafe calls.
struct RelaxedCapture(sys::CUstreamCaptureMode);

impl RelaxedCapture {
    fn enter() -> Result<Self> {
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: exchanges this thread's capture mode through a valid pointer.
        unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) }.result()?;
        Ok(Self(mode))
    }
}

impl Drop for RelaxedCapture {
    fn drop(&mut self) {
        // SAFETY: as in `enter`; restoring the mode `enter` read cannot fail.
        let _ = unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut self.0) };
    }
}

/// One context's kernels: those loaded so far, and their occupancy.
pub(crate) struct Kernels {
    ctx: Arc<CudaContext>,
    /// The build this context loads its kernels from.
    ptx: &'static Split,
    /// Each kernel asked for, loaded once its slot holds it (a slot of its own, so that a
    /// kernel being JIT-compiled holds up only the callers of that kernel).
    functions: Mutex<HashMap<Kernel, Arc<Mutex<Option<CudaFunction>>>>>,
    /// Resident blocks per SM, keyed by (function handle, threads, dynamic shared bytes).
    occupancy: Mutex<HashMap<(usize, u32, u32), u32>>,
    /// Resident clusters on the whole device, keyed by (function handle, threads, dynamic
    /// shared bytes, blocks per cluster).
    clusters: Mutex<HashMap<(usize, u32, u32, u32), usize>>,
    sm_count: u32,
    /// Dynamic shared memory a block may opt in to on this device, in bytes.
    pub(crate) max_shared: u32,
    /// [`PTX_SM90`] is in use: the RMSNorm dW reduction is launched as a programmatic
    /// dependent launch, and the shared-memory dW backward in clusters (see there).
    pub(crate) sm90: bool,
    /// Scratch kept between calls (the RMSNorm backward's dW partial rows).
    pub(crate) scratch: ScratchPool,
}

impl Kernels {
    /// `kernel`'s function, loaded (its module JIT-compiled) at its first use in this context.
    pub(crate) fn function(&self, kernel: Kernel) -> Result<CudaFunction> {
        let slot = lock(&self.functions).entry(kernel).or_default().clone();
        let mut slot = lock(&slot);
        if let Some(f) = slot.as_ref() {
            return Ok(f.clone());
        }
        let name = kernel.name();
        // A name the build lacks fails as the driver's lookup of it would.
        let not_found = || Error::Driver(DriverError(sys::CUresult::CUDA_ERROR_NOT_FOUND));
        let ptx = self.ptx.module(&name).ok_or_else(not_found)?;
        let module = {
            let _relaxed = RelaxedCapture::enter()?;
            self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?
        };
        let f = module.load_function(&name)?;
        *slot = Some(f.clone());
        Ok(f)
    }

    /// The device's streaming multiprocessors.
    pub(crate) fn sm_count(&self) -> usize {
        self.sm_count as usize
    }

    /// Blocks of `func` that fit on the whole device at once with `threads` threads and
    /// `smem` bytes of dynamic shared memory per block (SMs × resident blocks per SM, at least
    /// 1): the grid of a grid-stride kernel. Asked of the driver once per shape; a handle is
    /// never reused for another function, since its module lives as long as the process.
    pub(crate) fn resident_blocks(
        &self,
        func: &CudaFunction,
        threads: u32,
        smem: u32,
    ) -> Result<usize> {
        let key = (func.cu_function() as usize, threads, smem);
        if let Some(&n) = lock(&self.occupancy).get(&key) {
            return Ok(self.sm_count as usize * n as usize);
        }
        let n = func
            .occupancy_max_active_blocks_per_multiprocessor(threads, smem as usize, None)?
            .max(1);
        lock(&self.occupancy).insert(key, n);
        Ok(self.sm_count as usize * n as usize)
    }

    /// Clusters of `blocks` blocks of `func` (`threads` threads, `smem` bytes of dynamic shared
    /// memory each) that fit on the whole device at once (`cuOccupancyMaxActiveClusters`; a
    /// cluster's blocks share one GPC, so this can be below the resident blocks / `blocks`).
    /// Asked of the driver once per shape, in `ctx` (this context); only with [`PTX_SM90`] in
    /// use.
    pub(crate) fn resident_clusters(
        &self,
        ctx: &CudaContext,
        func: &CudaFunction,
        threads: u32,
        smem: u32,
        blocks: u32,
    ) -> Result<usize> {
        let key = (func.cu_function() as usize, threads, smem, blocks);
        if let Some(&n) = lock(&self.clusters).get(&key) {
            return Ok(n);
        }
        let mut attr = cluster_attribute(blocks);
        let config = sys::CUlaunchConfig {
            gridDimX: blocks,
            gridDimY: 1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: std::ptr::null_mut(),
            attrs: &mut attr,
            numAttrs: 1,
        };
        let mut n = 0;
        ctx.bind_to_thread()?;
        // SAFETY: writes one int; `config` and `attr` outlive the call.
        unsafe { sys::cuOccupancyMaxActiveClusters(&mut n, func.cu_function(), &config) }
            .result()?;
        let n = n.max(0) as usize;
        lock(&self.clusters).insert(key, n);
        Ok(n)
    }
}

/// The launch attribute for clusters of `blocks` blocks along x.
pub(crate) fn cluster_attribute(blocks: u32) -> sys::CUlaunchAttribute {
    // SAFETY: a zeroed attribute is valid (the union's pad covers every member); the id and
    // its member are set next.
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
    attr.value.clusterDim.x = blocks;
    attr.value.clusterDim.y = 1;
    attr.value.clusterDim.z = 1;
    attr
}

/// Contexts seen so far (keyed by `CUcontext`; [`Kernels`] keeps its context alive, so a key
/// is never reused by another context while it is in the cache).
static CACHE: Mutex<Vec<(usize, Arc<Kernels>)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The kernels of `ctx` (none loaded yet at its first call).
pub(crate) fn kernels(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>> {
    let mut cache = lock(&CACHE);
    if let Some(k) = cached(&cache, ctx) {
        return Ok(k);
    }
    let sm90 = sm90_build(ctx)?;
    let ptx = match sm90 {
        true => split(&SPLIT_SM90, PTX_SM90),
        false => split(&SPLIT, PTX),
    };
    let sm_count =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let max_shared = ctx.attribute(
        sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
    )?;
    let kernels = Arc::new(Kernels {
        ctx: ctx.clone(),
        ptx,
        functions: Mutex::new(HashMap::new()),
        occupancy: Mutex::new(HashMap::new()),
        clusters: Mutex::new(HashMap::new()),
        sm_count: sm_count.max(1) as u32,
        max_shared: max_shared.max(0) as u32,
        sm90,
        scratch: ScratchPool::new(ctx)?,
    });
    cache.push((ctx.cu_ctx() as usize, kernels.clone()));
    Ok(kernels)
}

/// [`PTX`] cut into its kernels' modules, once per process.
static SPLIT: OnceLock<Split> = OnceLock::new();
/// [`PTX_SM90`] cut into its kernels' modules, once per process.
static SPLIT_SM90: OnceLock<Split> = OnceLock::new();

/// `ptx` cut into its kernels' modules in `cell`.
fn split(cell: &'static OnceLock<Split>, ptx: &'static str) -> &'static Split {
    cell.get_or_init(|| Split::new(ptx))
}

/// `ctx`'s kernels in `cache`, if it has been seen.
fn cached(cache: &[(usize, Arc<Kernels>)], ctx: &CudaContext) -> Option<Arc<Kernels>> {
    let key = ctx.cu_ctx() as usize;
    cache
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, k)| k.clone())
}

/// Frees the scratch that the RMSNorm backward keeps between calls on `ctx`'s streams (its dW
/// partial rows, see [`rms_norm_backward`](crate::rms_norm_backward)); later calls allocate
/// again. Safe to call from any thread at any time: each buffer is freed only after the work
/// queued on it so far (where the device supports stream-ordered allocation, behind an event
/// without blocking the host; elsewhere the host waits for that event first), and a buffer held
/// by a call in progress on another thread is left to that call. Nothing happens for a context
/// no call has used.
///
/// # Errors
/// [`Error::Driver`] when the driver refuses to queue a free; that buffer is then leaked,
/// never freed while in use.
///
/// ```no_run
/// let ctx = liger_rs::cuda_context(0)?;
/// // … training steps on ctx's streams …
/// liger_rs::release_scratch(&ctx)?;
/// # Ok::<(), liger_rs::Error>(())
/// ```
pub fn release_scratch(ctx: &CudaContext) -> Result<()> {
    let kernels = cached(&lock(&CACHE), ctx);
    match kernels {
        Some(kernels) => kernels.scratch.clear(),
        None => Ok(()),
    }
}

/// Whether `ctx` gets [`PTX_SM90`] (see there) rather than [`PTX`].
fn sm90_build(ctx: &CudaContext) -> Result<bool> {
    if std::env::var_os(BASELINE_PTX_ENV).is_some() || PTX_SM90.is_empty() {
        return Ok(false);
    }
    let major =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let mut driver = 0;
    // SAFETY: writes one int; the driver is loaded (a context exists).
    unsafe { sys::cuDriverGetVersion(&mut driver) }.result()?;
    Ok(major == 9 && driver >= SM90_MIN_DRIVER)
}

/// Whether the CUDA driver library loads under one of the names cudarc loads it by
/// (`libcuda.so`, `libcuda.so.1`, `nvcuda.dll`). Asked here rather than through cudarc, whose
/// own check exists only when it loads the driver itself: with cudarc's `dynamic-linking`
/// (candle-core turns it on) the library is already in the process and this holds.
fn driver_present() -> bool {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    ["cuda", "nvcuda"]
        .iter()
        .flat_map(|l| {
            [
                format!("{DLL_PREFIX}{l}{DLL_SUFFIX}"),
                format!("{DLL_PREFIX}{l}{DLL_SUFFIX}.1"),
            ]
        })
        // SAFETY: loading the driver library runs only its own initialisers, as cudarc's
        // loading does; the handle is dropped at once (the library stays if cudarc holds it).
        .any(|name| unsafe { libloading::Library::new(name) }.is_ok())
}

/// Opens device `ordinal` (its primary context), or explains why it cannot.
///
/// Unlike `CudaContext::new`, this never panics when the driver library is missing: it returns
/// [`Error::NoDriver`]; a missing device is [`Error::NoDevice`]. (With the `candle` feature
/// the driver library is linked, as candle-core has cudarc link it, so a program without it
/// does not start and [`Error::NoDriver`] does not occur.)
///
/// ```no_run
/// let ctx = liger_rs::cuda_context(0)?;
/// let stream = ctx.default_stream();
/// # Ok::<(), liger_rs::Error>(())
/// ```
pub fn cuda_context(ordinal: usize) -> Result<Arc<CudaContext>> {
    if !driver_present() {
        return Err(Error::NoDriver);
    }
    let count = match CudaContext::device_count() {
        Ok(n) => n.max(0) as usize,
        Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE => 0,
        Err(e) => return Err(e.into()),
    };
    if ordinal >= count {
        return Err(Error::NoDevice { ordinal, count });
    }
    Ok(CudaContext::new(ordinal)?)
}

/// For unit tests that check which kernels the host picks on the GPU the suites were tuned on:
/// device 0's context and kernels when it is an H200 (132 SMs, compute capability 9.0) with
/// [`PTX_SM90`] in use; otherwise `None`, after skipping `test` (on another GPU even where
/// `LIGER_RS_REQUIRE_GPU` is set: the choice depends on each kernel's occupancy, so other GPUs
/// pick otherwise).
#[cfg(test)]
pub(crate) fn h200_kernels(test: &str) -> Option<(Arc<CudaContext>, Arc<Kernels>)> {
    use crate::test_skip::{Need, skip};
    let ctx = match cuda_context(0) {
        Ok(ctx) => ctx,
        Err(e) => {
            skip(test, &format!("no GPU ({e})"), Need::Gpus(1));
            return None;
        }
    };
    let kernels = kernels(&ctx).expect("load the kernels");
    let cc = ctx.compute_capability().expect("compute capability");
    if kernels.sm_count != 132 || cc != (9, 0) || !kernels.sm90 {
        let why = format!(
            "not an H200 with the sm_90 build ({} SMs, compute capability {cc:?}, sm_90 \
             build {})",
            kernels.sm_count, kernels.sm90
        );
        skip(test, &why, Need::H200);
        return None;
    }
    Some((ctx, kernels))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Asserts that each kernel's entry, in both builds, takes exactly one parameter: a
    /// by-value block of `size` bytes (the host's `#[repr(C)]` parameter struct).
    pub(crate) fn assert_one_param_block(kernels: &[Kernel], size: usize) {
        for ptx in [PTX, PTX_SM90] {
            for k in kernels {
                let name = k.name();
                let entry = ptx
                    .split(".visible .entry ")
                    .find(|e| e.starts_with(&format!("{name}(")))
                    .unwrap_or_else(|| panic!("{name} is not in the PTX"));
                let params = &entry[..entry.find(')').unwrap()];
                assert_eq!(params.matches(".param").count(), 1, "{name}: {params}");
                let decl = format!(".param .align 8 .b8 {name}_param_0[{size}]");
                assert!(params.contains(&decl), "{name}: {params}, expected {decl}");
            }
        }
    }

    /// Each entry point's name and body in one PTX file, in order.
    fn entries(ptx: &str) -> Vec<(&str, &str)> {
        ptx.split(".visible .entry ")
            .skip(1)
            .map(|e| (e.split('(').next().unwrap_or(e), e))
            .collect()
    }

    #[test]
    fn the_launchers_ask_for_exactly_the_kernels_of_both_builds() {
        use std::collections::BTreeSet;
        let launchable: BTreeSet<String> = [
            crate::rms_norm::plan::tests::launchable_kernels(),
            crate::rope::plan::tests::launchable_kernels(),
            crate::glu::plan::tests::launchable_kernels(),
            crate::attention::plan::tests::launchable_kernels(),
            crate::cross_entropy::plan::tests::launchable_kernels(),
            crate::adamw::plan::tests::launchable_kernels(),
            crate::embedding::plan::tests::launchable_kernels(),
        ]
        .into_iter()
        .flatten()
        .map(|k| k.name())
        .collect();
        for ptx in [PTX, PTX_SM90] {
            let names: BTreeSet<String> = Split::new(ptx).names().map(String::from).collect();
            let missing: Vec<_> = launchable.difference(&names).collect();
            assert!(missing.is_empty(), "not in the PTX: {missing:?}");
            let unused: Vec<_> = names.difference(&launchable).collect();
            assert!(unused.is_empty(), "never launched: {unused:?}");
        }
        // RoPE's 244 (3 element types × 2 directions × 26 paths and row sources: 4 each of
        // scalar, contiguous vector and interleaved vector, 7 each of vector-any and general;
        // and f32 tables with the two 16-bit types on every path but the scalar one, 2 × 2 ×
        // 22) the other ops' 347, attention's 24 (the forward, dQ and dK/dV on SIMT for three
        // element types and on tensor cores for two at two head_dims; the preprocessing), and
        // cross-entropy's 29 (forward and backward rows on four paths for three element
        // types, the staged forward for three; the count and the reduction), and the optimizers' 31 (the AdamW update with
        // f32 or bf16 moments and the SGD update, each for three gradient types with no copy
        // or an f16 or bf16 copy; the sums of squares; the norm), and the embedding's 12 (the
        // forward and backward for three element types and two id types).
        assert_eq!(launchable.len(), 687);
    }

    #[test]
    fn the_sm90_build_differs_only_in_the_hand_offs_and_cluster_merges() {
        let (base, sm90) = (entries(PTX), entries(PTX_SM90));
        let names = |e: &[(&'static str, &str)]| e.iter().map(|(n, _)| *n).collect::<Vec<_>>();
        assert_eq!(names(&base), names(&sm90));
        assert!(!PTX.contains("griddepcontrol") && !PTX.contains("cluster"));
        let mut clustered = 0;
        for (name, body) in sm90 {
            let waits = usize::from(name.starts_with("rms_norm_dw_reduce_"));
            let triggers = usize::from(
                name.starts_with("rms_norm_bwd_v2_f32_")
                    || name.starts_with("rms_norm_add_bwd_v2_f32_"),
            );
            assert_eq!(
                body.matches("griddepcontrol").count(),
                waits + triggers,
                "{name}"
            );
            assert_eq!(
                body.matches("griddepcontrol.wait;").count(),
                waits,
                "{name}"
            );
            assert_eq!(
                body.matches("griddepcontrol.launch_dependents;").count(),
                triggers,
                "{name}"
            );
            // The cluster merges: two cluster barriers and the remote loads, in the
            // shared-memory dW backward kernels and the staged cross-entropy forward only.
            let merges = name.starts_with("rms_norm_bwd_vs")
                || name.starts_with("rms_norm_add_bwd_vs")
                || name.starts_with("ce_fwd_s_");
            clustered += usize::from(merges);
            assert_eq!(
                body.matches("barrier.cluster.arrive.aligned;").count(),
                2 * usize::from(merges),
                "{name}"
            );
            assert_eq!(body.contains("ld.shared::cluster.v4.b32"), merges, "{name}");
        }
        // bf16, f16 `_vs1` / `_vs2` in four modes; f32 `_vs1` in three (no `llama_offset`);
        // RMSNorm's and the fused residual add's; the staged forward for three types.
        assert_eq!(clustered, 2 * 19 + 3);
    }

    #[test]
    fn the_sm90_build_multiplies_the_tensor_core_attention_with_wgmma() {
        for (name, body) in entries(PTX_SM90) {
            let tensor_cores = name.starts_with("attn_") && name.contains("_mma");
            assert_eq!(body.contains("wgmma.mma_async"), tensor_cores, "{name}");
            assert!(!body.contains("mma.sync"), "{name}");
        }
        for (name, body) in entries(PTX) {
            assert!(!body.contains("wgmma"), "{name}");
            let mma_sync = name.starts_with("attn_") && name.contains("_mma");
            assert_eq!(body.contains("mma.sync"), mma_sync, "{name}");
        }
    }
}
