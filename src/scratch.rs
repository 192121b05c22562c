//! Device scratch kept between calls, per stream: the RMSNorm backward's dW partial rows.
//!
//! A stream-ordered allocation per call (`cuMemAllocAsync` before the backward, `cuMemFreeAsync`
//! after its dW reduction) cost the bf16 16384 × 2048 / 4096 backward 1.2–1.4 µs per call on an
//! H200 (PERFORMANCE.md, fourteenth session), so an eager call reuses its stream's buffer from
//! the call before. Calls on one stream run in stream order, so a buffer used by one stream only
//! is never read by one call while the next writes it; each call holds its stream's entry from
//! its first launch to its last, so calls from several host threads on one stream cannot
//! interleave their launches around it. A call on a stream that is being captured into a graph
//! allocates its own buffer as before (the graph then owns it, and a graph launched on any
//! stream, or instantiated twice, has its own).
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, sys};
use std::sync::{Arc, Mutex, MutexGuard};

/// Streams per context whose scratch is kept; using one more drops the least recently used
/// (its buffer is freed stream-ordered on its own stream, after the work queued there).
pub(crate) const KEPT_STREAMS: usize = 8;

/// One stream's kept buffer and its device address, once allocated. The buffer holds its
/// stream alive, so the handle it is kept under names no other stream while it exists (an
/// entry without a buffer may pass to a later stream with a recycled handle: nothing to share).
type Entry = Option<(CudaSlice<f32>, u64)>;

/// The kept scratch of one context's streams by stream handle, least recently used first.
#[derive(Default)]
pub(crate) struct ScratchCache {
    entries: Mutex<Vec<(usize, Arc<Mutex<Entry>>)>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl ScratchCache {
    /// Runs `f` with the device address of at least `len` f32 of scratch for work that `f`
    /// queues on `stream`, and returns what `f` returns. Outside a capture the buffer is
    /// `stream`'s kept one (replaced by a longer one first when it is shorter), and no other
    /// call on `stream` gets it until `f` returns; during a capture it is allocated for this
    /// call and freed stream-ordered after `f`. The contents are whatever the last user left:
    /// `f`'s kernels must write every element they read.
    pub(crate) fn with<R>(
        &self,
        stream: &Arc<CudaStream>,
        len: usize,
        f: impl FnOnce(u64) -> Result<R>,
    ) -> Result<R> {
        if stream.capture_status()? != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE {
            // SAFETY: uninitialised device memory, which `f` writes before reading (above).
            let mut buffer = unsafe { stream.alloc::<f32>(len) }?;
            let (ptr, _record) = buffer.device_ptr_mut(stream);
            return f(ptr);
        }
        let entry = self.entry(stream);
        let mut entry = lock(&entry);
        let ptr = match &*entry {
            Some((b, ptr)) if b.len() >= len => *ptr,
            _ => {
                // The shorter buffer is freed on its stream after the calls queued before.
                *entry = None;
                // SAFETY: as above.
                let mut b = unsafe { stream.alloc::<f32>(len) }?;
                let ptr = raw_ptr(&mut b);
                *entry = Some((b, ptr));
                ptr
            }
        };
        f(ptr)
    }

    /// `stream`'s entry, made the most recently used; a new one drops the least recently used
    /// beyond [`KEPT_STREAMS`].
    fn entry(&self, stream: &CudaStream) -> Arc<Mutex<Entry>> {
        let mut entries = lock(&self.entries);
        let handle = stream.cu_stream() as usize;
        let entry = match entries.iter().position(|(h, _)| *h == handle) {
            Some(i) => entries.remove(i).1,
            None => Arc::default(),
        };
        entries.push((handle, entry.clone()));
        if entries.len() > KEPT_STREAMS {
            entries.remove(0);
        }
        entry
    }

    /// Drops every kept buffer (each freed stream-ordered on its stream) and the streams held.
    pub(crate) fn clear(&self) {
        lock(&self.entries).clear();
    }

    /// The kept buffers' lengths in f32 by stream handle, least recently used first.
    #[cfg(test)]
    pub(crate) fn kept(&self) -> Vec<(usize, usize)> {
        lock(&self.entries)
            .iter()
            .map(|(h, e)| (*h, lock(e).as_ref().map_or(0, |(b, _)| b.len())))
            .collect()
    }
}

/// The new buffer's device address, taken once: it is only ever used on the stream that
/// allocated it, in stream order, so cudarc's cross-stream event bookkeeping (a wait per use
/// in multi-stream mode) has nothing to order.
fn raw_ptr(buffer: &mut CudaSlice<f32>) -> u64 {
    let stream = buffer.stream().clone();
    let (ptr, record) = buffer.device_ptr_mut(&stream);
    std::mem::forget(record);
    ptr
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_skip::{Need, skip};
    use cudarc::driver::CudaContext;
    use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};

    /// A new handle on device 0's primary context without cudarc's event tracking (a capture
    /// must not wait on events recorded before it), or `None` after skipping `test`.
    fn context(test: &str) -> Option<Arc<CudaContext>> {
        match crate::cuda_context(0) {
            Ok(ctx) => {
                // SAFETY: each stream's buffers in these tests are used on that stream only.
                unsafe { ctx.disable_event_tracking() };
                Some(ctx)
            }
            Err(e) => {
                let test = format!("scratch::tests::{test}");
                skip(&test, &format!("no GPU ({e})"), Need::Gpus(1));
                None
            }
        }
    }

    fn address(cache: &ScratchCache, stream: &Arc<CudaStream>, len: usize) -> u64 {
        cache.with(stream, len, Ok).unwrap()
    }

    #[test]
    fn gpu_a_stream_keeps_its_buffer_until_a_longer_one_is_needed() {
        let Some(ctx) = context("gpu_a_stream_keeps_its_buffer_until_a_longer_one_is_needed")
        else {
            return;
        };
        let (cache, s) = (ScratchCache::default(), ctx.new_stream().unwrap());
        let h = s.cu_stream() as usize;
        let first = address(&cache, &s, 1000);
        assert_eq!(address(&cache, &s, 1000), first);
        assert_eq!(address(&cache, &s, 10), first);
        assert_eq!(cache.kept(), [(h, 1000)]);
        address(&cache, &s, 1001);
        assert_eq!(cache.kept(), [(h, 1001)]);
        // Another stream gets a buffer of its own.
        let t = ctx.new_stream().unwrap();
        assert_ne!(address(&cache, &t, 10), address(&cache, &s, 10));
        assert_eq!(cache.kept(), [(t.cu_stream() as usize, 10), (h, 1001)]);
        cache.clear();
        assert!(cache.kept().is_empty());
        s.synchronize().unwrap();
    }

    #[test]
    fn gpu_streams_beyond_the_kept_ones_drop_the_least_recently_used() {
        let Some(ctx) = context("gpu_streams_beyond_the_kept_ones_drop_the_least_recently_used")
        else {
            return;
        };
        let cache = ScratchCache::default();
        let streams: Vec<_> = (0..KEPT_STREAMS + 2)
            .map(|_| ctx.new_stream().unwrap())
            .collect();
        let handle = |i: usize| streams[i].cu_stream() as usize;
        for (i, s) in streams.iter().take(KEPT_STREAMS).enumerate() {
            address(&cache, s, 100 + i);
        }
        // Stream 0 used again: stream 1 is now the least recently used, and goes first.
        address(&cache, &streams[0], 1);
        address(&cache, &streams[KEPT_STREAMS], 7);
        let kept = cache.kept();
        assert_eq!(kept.len(), KEPT_STREAMS);
        assert!(!kept.iter().any(|&(h, _)| h == handle(1)), "{kept:?}");
        assert_eq!(kept[KEPT_STREAMS - 2], (handle(0), 100));
        assert_eq!(kept[KEPT_STREAMS - 1], (handle(KEPT_STREAMS), 7));
        // A dropped stream allocates again when it comes back.
        address(&cache, &streams[1], 5);
        assert_eq!(cache.kept().last(), Some(&(handle(1), 5)));
        assert!(!cache.kept().iter().any(|&(h, _)| h == handle(2)));
        for s in &streams {
            s.synchronize().unwrap();
        }
    }

    #[test]
    fn gpu_a_capturing_stream_gets_a_buffer_of_its_own() {
        let Some(ctx) = context("gpu_a_capturing_stream_gets_a_buffer_of_its_own") else {
            return;
        };
        let (cache, s) = (ScratchCache::default(), ctx.new_stream().unwrap());
        let kept = address(&cache, &s, 4096);
        s.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .unwrap();
        let captured = address(&cache, &s, 4096);
        s.end_capture(CUgraphInstantiate_flags(0)).unwrap();
        assert_ne!(captured, kept);
        assert_eq!(cache.kept(), [(s.cu_stream() as usize, 4096)]);
        assert_eq!(address(&cache, &s, 4096), kept);
        s.synchronize().unwrap();
    }
}
