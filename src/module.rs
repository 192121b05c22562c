//! The embedded PTX, loaded once per CUDA context and cached for the life of the process.
use crate::error::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, sys};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

/// PTX of every kernel, built from `kernels-gpu` by `build.rs` (sm_80 baseline, JIT-compiled
/// forward by the driver on newer GPUs).
///
/// ```
/// assert!(liger_rs::PTX.contains(".visible .entry rms_norm_fwd_bf16_llama"));
/// ```
pub const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/kernels.ptx"));

/// One context's loaded module, the functions looked up in it so far, and their occupancy.
pub(crate) struct Kernels {
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, CudaFunction>>,
    /// Resident blocks per SM, keyed by (function handle, threads, dynamic shared bytes).
    occupancy: Mutex<HashMap<(usize, u32, u32), u32>>,
    sm_count: u32,
}

impl Kernels {
    /// The kernel called `name`, looked up once.
    pub(crate) fn function(&self, name: &str) -> Result<CudaFunction> {
        let mut functions = lock(&self.functions);
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let f = self.module.load_function(name)?;
        functions.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// Blocks of `func` that fit on the whole device at once with `threads` threads and
    /// `smem` bytes of dynamic shared memory per block (SMs × resident blocks per SM, at least
    /// 1): the grid of a grid-stride kernel. Asked of the driver once per shape; a handle is
    /// never reused for another function, since the module lives as long as the process.
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
}

/// Contexts seen so far (keyed by `CUcontext`; the module keeps its context alive, so a key
/// is never reused by another context while it is in the cache).
static CACHE: Mutex<Vec<(usize, Arc<Kernels>)>> = Mutex::new(Vec::new());

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The kernels of `ctx`, loading the PTX into it on first use.
pub(crate) fn kernels(ctx: &Arc<CudaContext>) -> Result<Arc<Kernels>> {
    let key = ctx.cu_ctx() as usize;
    let mut cache = lock(&CACHE);
    if let Some((_, k)) = cache.iter().find(|(k, _)| *k == key) {
        return Ok(k.clone());
    }
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(PTX))?;
    let sm_count =
        ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let kernels = Arc::new(Kernels {
        module,
        functions: Mutex::new(HashMap::new()),
        occupancy: Mutex::new(HashMap::new()),
        sm_count: sm_count.max(1) as u32,
    });
    cache.push((key, kernels.clone()));
    Ok(kernels)
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
