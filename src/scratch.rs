//! Device scratch reused between calls: the RMSNorm backward's dW partial rows.
//!
//! Safe under every kind of stream and any number of host threads by construction:
//! * A buffer is reused only by a call on the stream that used it last, as the driver
//!   identifies it (`cuStreamGetId`: unique for the life of the process, and distinct for each
//!   thread's per-thread stream although they share one handle), so stream order puts the last
//!   call's reads before the next call's writes.
//! * A call takes its buffer out of the pool until its last launch is queued, so concurrent
//!   calls (several threads on one stream included) never hold the same buffer.
//! * After each call an event is recorded on its stream, and a buffer is freed only after that
//!   event, on a stream the pool owns: eviction and [`release_scratch`](crate::release_scratch)
//!   can run on any thread without naming the stream that used the buffer (another thread's
//!   per-thread stream cannot be named, and a borrowed stream may be gone).
//! * A call on a stream being captured into a graph allocates and frees its own buffer inside
//!   the capture (the graph's memory nodes) and never touches the pool, whose buffers the
//!   graph's later launches could otherwise race with. A capture that another thread begins
//!   on the stream while a call holds a pool buffer takes that buffer with it: the pool leaks
//!   it rather than reuse or free what the graph's launches write.
use crate::error::Result;
use cudarc::driver::{CudaContext, CudaStream, result, sys};
use std::sync::{Arc, Mutex, MutexGuard};

/// Buffers a context keeps between calls; one more frees the least recently used.
pub(crate) const KEPT: usize = 8;

/// One kept buffer (a null `ptr` before its first allocation) and the stream that used it last.
struct Scratch {
    ptr: sys::CUdeviceptr,
    len: usize,
    stream_id: u64,
    /// Recorded on that stream after the call's last launch.
    last_use: sys::CUevent,
}

// SAFETY: a device address and an event handle are driver handles valid on every thread; the
// pool hands each `Scratch` to one call at a time.
unsafe impl Send for Scratch {}

/// The kept scratch of one context, least recently used first.
pub(crate) struct ScratchPool {
    ctx: Arc<CudaContext>,
    idle: Mutex<Vec<Scratch>>,
    /// The device supports stream-ordered allocation (`cuMemAllocAsync`); without it
    /// allocation is synchronous and a free waits for the buffer's last use on the host.
    pools: bool,
    /// The pool's own stream for frees (created on first use), never captured.
    release: Mutex<Option<usize>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The driver's id of the stream `stream` names on this thread (see the module docs).
pub(crate) fn stream_id(stream: &CudaStream) -> Result<u64> {
    stream.context().bind_to_thread()?;
    let mut id = 0;
    // SAFETY: writes one integer; the handle is a live stream of the bound context.
    unsafe { sys::cuStreamGetId(stream.cu_stream(), &mut id) }.result()?;
    Ok(id)
}

impl ScratchPool {
    pub(crate) fn new(ctx: &Arc<CudaContext>) -> Result<Self> {
        let pools =
            ctx.attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED)?;
        Ok(ScratchPool {
            ctx: ctx.clone(),
            idle: Mutex::new(Vec::new()),
            pools: pools != 0,
            release: Mutex::new(None),
        })
    }

    /// Runs `f` with the device address of at least `len` f32 of scratch for work that `f`
    /// queues on `stream`, and returns what `f` returns. The contents are whatever the last
    /// user left: `f`'s kernels must write every element they read.
    pub(crate) fn with<R>(
        &self,
        stream: &CudaStream,
        len: usize,
        f: impl FnOnce(u64) -> Result<R>,
    ) -> Result<R> {
        let bytes = len.max(1) * std::mem::size_of::<f32>();
        let handle = stream.cu_stream();
        if stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            // SAFETY: a stream-ordered allocation on the bound context, freed after `f`'s
            // launches in the same stream order (both become memory nodes of the graph).
            let ptr = unsafe { result::malloc_async(handle, bytes) }?;
            let out = f(ptr);
            // SAFETY: as above; queued after everything `f` queued.
            unsafe { result::free_async(ptr, handle) }?;
            return out;
        }
        let id = stream_id(stream)?;
        let mut scratch = match self.take(id) {
            Some(s) => s,
            None => Scratch {
                ptr: 0,
                len: 0,
                stream_id: id,
                last_use: result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?,
            },
        };
        if scratch.len < len {
            if scratch.ptr != 0 {
                self.free_after(scratch.ptr, scratch.last_use)?;
            }
            scratch.ptr = 0;
            scratch.len = 0;
            match self.alloc(handle, bytes) {
                Ok(ptr) => (scratch.ptr, scratch.len) = (ptr, len),
                Err(e) => {
                    // SAFETY: this event was only ever recorded before the buffer just freed.
                    unsafe { result::event::destroy(scratch.last_use) }?;
                    return Err(e);
                }
            }
        }
        let out = f(scratch.ptr);
        // Recorded even when `f` failed, which may have queued a launch before failing; if the
        // record itself fails, the buffer is leaked rather than freed while possibly in use.
        // SAFETY: a live event and stream of the bound context.
        unsafe { result::event::record(scratch.last_use, handle) }?;
        // A capture another thread began on this stream during `f` took `f`'s launches into
        // its graph, whose every replay uses the buffer: it is leaked, never reused or freed.
        if stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            return out;
        }
        scratch.stream_id = id;
        let evicted = {
            let mut idle = lock(&self.idle);
            idle.push(scratch);
            (idle.len() > KEPT).then(|| idle.remove(0))
        };
        if let Some(old) = evicted {
            self.free(old)?;
        }
        out
    }

    /// The most recently used idle buffer of stream `id`, taken out of the pool.
    fn take(&self, id: u64) -> Option<Scratch> {
        let mut idle = lock(&self.idle);
        let i = idle.iter().rposition(|s| s.stream_id == id)?;
        Some(idle.remove(i))
    }

    fn alloc(&self, stream: sys::CUstream, bytes: usize) -> Result<sys::CUdeviceptr> {
        self.ctx.bind_to_thread()?;
        // SAFETY: allocations on the bound context; the memory is written before it is read.
        Ok(match self.pools {
            true => unsafe { result::malloc_async(stream, bytes) }?,
            false => unsafe { result::malloc_sync(bytes) }?,
        })
    }

    /// Frees `ptr` once the work recorded in `last_use` is done, without blocking the host
    /// where the device allows it. On an error the buffer is leaked, never freed early.
    fn free_after(&self, ptr: sys::CUdeviceptr, last_use: sys::CUevent) -> Result<()> {
        self.ctx.bind_to_thread()?;
        if !self.pools {
            // SAFETY: a live event; then a buffer no queued work uses any more.
            unsafe { result::event::synchronize(last_use) }?;
            return Ok(unsafe { result::free_sync(ptr) }?);
        }
        let stream = self.release_stream()?;
        // SAFETY: live handles of the bound context; the free is queued behind the wait.
        unsafe {
            result::stream::wait_event(
                stream,
                last_use,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )?;
            result::free_async(ptr, stream)?;
        }
        Ok(())
    }

    /// Frees a buffer taken out of the pool, and its event.
    fn free(&self, s: Scratch) -> Result<()> {
        if s.ptr != 0 {
            self.free_after(s.ptr, s.last_use)?;
        }
        // SAFETY: a live event; destroying it after a wait on it was queued is allowed (its
        // resources go once the wait is done).
        Ok(unsafe { result::event::destroy(s.last_use) }?)
    }

    /// The pool's stream for frees, created on first use.
    fn release_stream(&self) -> Result<sys::CUstream> {
        let mut release = lock(&self.release);
        if let Some(s) = *release {
            return Ok(s as sys::CUstream);
        }
        let s = result::stream::create(result::stream::StreamKind::NonBlocking)?;
        *release = Some(s as usize);
        Ok(s)
    }

    /// Frees every idle buffer (each after its last use, without blocking the host where the
    /// device allows it). Buffers held by calls in progress return to the pool after them.
    pub(crate) fn clear(&self) -> Result<()> {
        let idle = std::mem::take(&mut *lock(&self.idle));
        let mut first = Ok(());
        for s in idle {
            let r = self.free(s);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// The idle buffers' lengths in f32 by stream id, least recently used first.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> Vec<(u64, usize)> {
        lock(&self.idle)
            .iter()
            .map(|s| (s.stream_id, s.len))
            .collect()
    }
}

impl Drop for ScratchPool {
    fn drop(&mut self) {
        // Errors here have no caller to go to; a buffer that cannot be freed is leaked.
        let _ = self.clear();
        if let Some(s) = *lock(&self.release) {
            // SAFETY: the pool's own stream; pending frees finish before its resources go.
            let _ = unsafe { result::stream::destroy(s as sys::CUstream) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_skip::{Need, skip};
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

    /// Device 0's context, or `None` after skipping `test`.
    fn context(test: &str) -> Option<Arc<CudaContext>> {
        match crate::cuda_context(0) {
            Ok(ctx) => Some(ctx),
            Err(e) => {
                let test = format!("scratch::tests::{test}");
                skip(&test, &format!("no GPU ({e})"), Need::Gpus(1));
                None
            }
        }
    }

    fn address(pool: &ScratchPool, stream: &CudaStream, len: usize) -> u64 {
        pool.with(stream, len, Ok).unwrap()
    }

    #[test]
    fn gpu_a_stream_keeps_its_buffer_until_a_longer_one_is_needed() {
        let Some(ctx) = context("gpu_a_stream_keeps_its_buffer_until_a_longer_one_is_needed")
        else {
            return;
        };
        let (pool, s) = (ScratchPool::new(&ctx).unwrap(), ctx.new_stream().unwrap());
        let id = stream_id(&s).unwrap();
        let first = address(&pool, &s, 1000);
        assert_eq!(address(&pool, &s, 1000), first);
        assert_eq!(address(&pool, &s, 10), first);
        assert_eq!(pool.kept(), [(id, 1000)]);
        address(&pool, &s, 1001);
        assert_eq!(pool.kept(), [(id, 1001)]);
        // Another stream gets a buffer of its own.
        let t = ctx.new_stream().unwrap();
        assert_ne!(address(&pool, &t, 10), address(&pool, &s, 10));
        assert_eq!(pool.kept(), [(stream_id(&t).unwrap(), 10), (id, 1001)]);
        pool.clear().unwrap();
        assert!(pool.kept().is_empty());
        s.synchronize().unwrap();
    }

    #[test]
    fn gpu_per_thread_streams_of_two_threads_never_share_a_buffer() {
        let Some(ctx) = context("gpu_per_thread_streams_of_two_threads_never_share_a_buffer")
        else {
            return;
        };
        let pool = ScratchPool::new(&ctx).unwrap();
        // One `CudaStream` value, one handle (0x2), two streams: one per thread.
        let s = ctx.per_thread_stream();
        let mine = address(&pool, &s, 100);
        let (theirs, their_id) = std::thread::scope(|scope| {
            scope
                .spawn(|| (address(&pool, &s, 100), stream_id(&s).unwrap()))
                .join()
                .unwrap()
        });
        assert_ne!(their_id, stream_id(&s).unwrap());
        assert_ne!(theirs, mine);
        assert_eq!(address(&pool, &s, 100), mine);
        assert_eq!(pool.kept().len(), 2);
        s.synchronize().unwrap();
    }

    #[test]
    fn gpu_a_call_in_progress_holds_its_buffer() {
        let Some(ctx) = context("gpu_a_call_in_progress_holds_its_buffer") else {
            return;
        };
        let (pool, s) = (ScratchPool::new(&ctx).unwrap(), ctx.new_stream().unwrap());
        let outer = address(&pool, &s, 64);
        // A second call on the same stream while the first holds the buffer (as another thread
        // would) gets another one, and the first is not freed by a clear meanwhile.
        let inner = pool
            .with(&s, 64, |held| {
                assert_eq!(held, outer);
                pool.clear()?;
                Ok(address(&pool, &s, 64))
            })
            .unwrap();
        assert_ne!(inner, outer);
        let kept: Vec<_> = pool.kept().iter().map(|k| k.1).collect();
        assert_eq!(kept, [64, 64]);
        s.synchronize().unwrap();
    }

    #[test]
    fn gpu_streams_beyond_the_kept_ones_drop_the_least_recently_used() {
        let Some(ctx) = context("gpu_streams_beyond_the_kept_ones_drop_the_least_recently_used")
        else {
            return;
        };
        let pool = ScratchPool::new(&ctx).unwrap();
        let streams: Vec<_> = (0..KEPT + 2).map(|_| ctx.new_stream().unwrap()).collect();
        let id = |i: usize| stream_id(&streams[i]).unwrap();
        for (i, s) in streams.iter().take(KEPT).enumerate() {
            address(&pool, s, 100 + i);
        }
        // Stream 0 used again: stream 1 is now the least recently used, and goes first.
        address(&pool, &streams[0], 1);
        address(&pool, &streams[KEPT], 7);
        let kept = pool.kept();
        assert_eq!(kept.len(), KEPT);
        assert!(!kept.iter().any(|&(h, _)| h == id(1)), "{kept:?}");
        assert_eq!(kept[KEPT - 2], (id(0), 100));
        assert_eq!(kept[KEPT - 1], (id(KEPT), 7));
        // A dropped stream allocates again when it comes back.
        address(&pool, &streams[1], 5);
        assert_eq!(pool.kept().last(), Some(&(id(1), 5)));
        assert!(!pool.kept().iter().any(|&(h, _)| h == id(2)));
        for s in &streams {
            s.synchronize().unwrap();
        }
    }

    /// A capture begun on the stream while a call holds its buffer (by another thread; here by
    /// the call's own work) leaves the buffer to the graph: the pool keeps nothing of it, and
    /// the next call gets another.
    #[test]
    fn gpu_a_capture_begun_during_a_call_takes_its_buffer_out_of_the_pool() {
        let test = "gpu_a_capture_begun_during_a_call_takes_its_buffer_out_of_the_pool";
        let Some(ctx) = context(test) else {
            return;
        };
        let (pool, s) = (ScratchPool::new(&ctx).unwrap(), ctx.new_stream().unwrap());
        let held = pool
            .with(&s, 4096, |ptr| {
                s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
                Ok(ptr)
            })
            .unwrap();
        s.end_capture(CUgraphInstantiate_flags(0)).unwrap();
        assert!(pool.kept().is_empty(), "{:?}", pool.kept());
        assert_ne!(address(&pool, &s, 4096), held);
        s.synchronize().unwrap();
    }

    #[test]
    fn gpu_a_capturing_stream_gets_a_buffer_of_its_own() {
        let Some(ctx) = context("gpu_a_capturing_stream_gets_a_buffer_of_its_own") else {
            return;
        };
        let (pool, s) = (ScratchPool::new(&ctx).unwrap(), ctx.new_stream().unwrap());
        let kept = address(&pool, &s, 4096);
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let captured = address(&pool, &s, 4096);
        s.end_capture(CUgraphInstantiate_flags(0)).unwrap();
        assert_ne!(captured, kept);
        assert_eq!(pool.kept(), [(stream_id(&s).unwrap(), 4096)]);
        assert_eq!(address(&pool, &s, 4096), kept);
        s.synchronize().unwrap();
    }
}
