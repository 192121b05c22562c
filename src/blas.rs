//! cuBLAS GEMMs for the ops that need them (fused linear cross-entropy), through cudarc's
//! `cublas` bindings, which load the library at run time: without it a call is
//! [`Error::NoBlas`], never a panic.
//!
//! Handles: one per host thread and CUDA context, created on first use and kept (creating one
//! costs a device allocation and a synchronisation). A handle is used by one thread at a
//! time, so calls never share one concurrently. Each call sets the handle's stream to its own
//! and gives cuBLAS a workspace allocated on that stream for the call (freed behind it): the
//! handle's default workspace would be shared by the GEMMs of every stream the thread uses,
//! which may run at once, and a capturing stream records the allocation as a graph node.
use crate::dtype::Dtype;
use crate::error::{Error, Result};
use crate::identity::ElemType;
use cudarc::cublas::{result as cublas, sys};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
use std::cell::RefCell;
use std::sync::Arc;

/// Bytes of the per-call workspace (NVIDIA's recommendation for Hopper).
const WORKSPACE_BYTES: usize = 32 << 20;

/// A handle and the context it was created in (kept alive while the handle is).
struct Handle {
    raw: sys::cublasHandle_t,
    ctx: Arc<CudaContext>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the handle was created by this thread and is not used after this; a
            // failure (the context already torn down) leaves nothing to clean up.
            let _ = unsafe { cublas::destroy_handle(self.raw) };
        }
    }
}

thread_local! {
    static HANDLES: RefCell<Vec<Handle>> = const { RefCell::new(Vec::new()) };
}

/// Whether the cuBLAS library loads under one of the names cudarc loads it by (with the
/// `candle` feature it is linked, so it is present whenever the program runs).
fn blas_present() -> bool {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    let names = [
        format!("{DLL_PREFIX}cublas{DLL_SUFFIX}"),
        format!("{DLL_PREFIX}cublas{DLL_SUFFIX}.13"),
        format!("{DLL_PREFIX}cublas{DLL_SUFFIX}.12"),
        format!("{DLL_PREFIX}cublas64_13{DLL_SUFFIX}"),
        format!("{DLL_PREFIX}cublas64_12{DLL_SUFFIX}"),
    ];
    // SAFETY: as the driver check in `module`: only the library's own initialisers run.
    names
        .iter()
        .any(|name| unsafe { libloading::Library::new(name) }.is_ok())
}

fn status(what: &'static str, e: cublas::CublasError) -> Error {
    Error::Blas {
        call: what,
        status: format!("{:?}", e.0),
    }
}

/// A GEMM operand's element type as cuBLAS names it.
pub(crate) fn data_type(elem: ElemType) -> sys::cudaDataType {
    match elem {
        ElemType::F32 => sys::cudaDataType::CUDA_R_32F,
        ElemType::F16 => sys::cudaDataType::CUDA_R_16F,
        ElemType::Bf16 => sys::cudaDataType::CUDA_R_16BF,
    }
}

/// One column-major GEMM `C = α·op(A)·op(B) + β·C` (`m × n`, inner `k`), f32 accumulation;
/// A and B of the call's element type, C of `c_type`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Gemm {
    pub(crate) trans_a: bool,
    pub(crate) trans_b: bool,
    pub(crate) m: usize,
    pub(crate) n: usize,
    pub(crate) k: usize,
    pub(crate) a: u64,
    pub(crate) lda: usize,
    pub(crate) b: u64,
    pub(crate) ldb: usize,
    pub(crate) c: u64,
    pub(crate) ldc: usize,
    pub(crate) c_type: ElemType,
    pub(crate) beta: f32,
}

/// A cuBLAS handle set to `stream` with a workspace of its own, for a run of GEMMs.
pub(crate) struct Blas<'s> {
    raw: sys::cublasHandle_t,
    _stream: &'s Arc<CudaStream>,
    _workspace: CudaSlice<u8>,
}

impl<'s> Blas<'s> {
    /// This thread's handle for the stream's context, set to `stream`.
    ///
    /// # Errors
    /// [`Error::NoBlas`] without the library; a cuBLAS or driver error.
    pub(crate) fn on(stream: &'s Arc<CudaStream>) -> Result<Self> {
        if !blas_present() {
            return Err(Error::NoBlas);
        }
        let ctx = stream.context();
        ctx.bind_to_thread()?;
        let raw = HANDLES.with(|h| -> Result<sys::cublasHandle_t> {
            let mut h = h.borrow_mut();
            if let Some(found) = h.iter().find(|x| Arc::ptr_eq(&x.ctx, ctx)) {
                return Ok(found.raw);
            }
            let raw = cublas::create_handle().map_err(|e| status("cublasCreate", e))?;
            h.push(Handle {
                raw,
                ctx: ctx.clone(),
            });
            Ok(raw)
        })?;
        // SAFETY: cuBLAS only writes the workspace before it reads it.
        let workspace = unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) }?;
        // SAFETY: the handle is this thread's; the stream and the workspace outlive every
        // GEMM queued through `self` (the workspace's free is ordered behind them).
        unsafe {
            cublas::set_stream(raw, stream.cu_stream() as _)
                .map_err(|e| status("cublasSetStream", e))?;
            let (ptr, _use) = workspace.device_ptr(stream);
            sys::cublasSetWorkspace_v2(raw, ptr as *mut _, WORKSPACE_BYTES)
                .result()
                .map_err(|e| status("cublasSetWorkspace", e))?;
        }
        Ok(Blas {
            raw,
            _stream: stream,
            _workspace: workspace,
        })
    }

    /// Queues `x ← α·x` over `n` elements of `T` (f32 arithmetic, one rounding), `α` an f32
    /// read from the device when the scale runs (a value computed on the stream needs no
    /// sync).
    ///
    /// # Safety
    /// `x` is a live device buffer of this context of at least `n` elements of `T`, and
    /// `alpha` one f32, both ordered on the stream.
    #[cfg(feature = "candle")]
    pub(crate) unsafe fn scale<T: Dtype>(&self, n: usize, alpha: u64, x: u64) -> Result<()> {
        let bytes = T::ELEM.size() as u64;
        // SAFETY: the caller vouches for the buffers; the pointer mode is the handle's
        // (this thread's alone) and is set back to host before returning, as `gemm` expects.
        unsafe {
            sys::cublasSetPointerMode_v2(
                self.raw,
                sys::cublasPointerMode_t::CUBLAS_POINTER_MODE_DEVICE,
            )
            .result()
            .map_err(|e| status("cublasSetPointerMode", e))?;
            let mut done = 0usize;
            let mut outcome = Ok(());
            while done < n && outcome.is_ok() {
                let part = (n - done).min(i32::MAX as usize);
                outcome = sys::cublasScalEx(
                    self.raw,
                    part as i32,
                    alpha as *const _,
                    sys::cudaDataType::CUDA_R_32F,
                    (x + done as u64 * bytes) as *mut _,
                    data_type(T::ELEM),
                    1,
                    sys::cudaDataType::CUDA_R_32F,
                )
                .result()
                .map_err(|e| status("cublasScalEx", e));
                done += part;
            }
            let host = sys::cublasSetPointerMode_v2(
                self.raw,
                sys::cublasPointerMode_t::CUBLAS_POINTER_MODE_HOST,
            )
            .result()
            .map_err(|e| status("cublasSetPointerMode", e));
            outcome.and(host)
        }
    }

    /// Queues `g` with A and B of `T` on the stream.
    ///
    /// # Safety
    /// Every pointer of `g` is a live device buffer of this context holding its operand in
    /// the layout `g` gives, ordered on the stream; C overlaps neither A nor B.
    pub(crate) unsafe fn gemm<T: Dtype>(&self, g: &Gemm) -> Result<()> {
        let dim = |v: usize, what: &'static str| {
            i32::try_from(v).map_err(|_| crate::error::invalid(what, "at most 2³¹ − 1", v))
        };
        let op = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let (alpha, beta) = (1.0f32, g.beta);
        // SAFETY: the caller vouches for the operands; alpha and beta are host f32 (the
        // handle's default pointer mode), as CUBLAS_COMPUTE_32F takes them.
        unsafe {
            cublas::gemm_ex(
                self.raw,
                op(g.trans_a),
                op(g.trans_b),
                dim(g.m, "gemm m")?,
                dim(g.n, "gemm n")?,
                dim(g.k, "gemm k")?,
                (&alpha) as *const f32 as *const _,
                g.a as *const _,
                data_type(T::ELEM),
                dim(g.lda, "gemm lda")?,
                g.b as *const _,
                data_type(T::ELEM),
                dim(g.ldb, "gemm ldb")?,
                (&beta) as *const f32 as *const _,
                g.c as *mut _,
                data_type(g.c_type),
                dim(g.ldc, "gemm ldc")?,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| status("cublasGemmEx", e))
    }
}
