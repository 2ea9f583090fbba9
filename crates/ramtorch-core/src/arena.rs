//! The host arena: page-locked host memory at exact sizes, recycled through a pool.
//!
//! Each [`Region`] is one anonymous mapping rounded up to whole pages (so 4 KiB at most is lost per
//! region, unlike a power-of-two caching allocator). Big regions are faulted in from several
//! threads before they are pinned, which is where most of the cost of pinning goes. When a region
//! is dropped its mapping goes back to a pool keyed by size (and whether it is pinned), still
//! pinned, so a gradient buffer freed by `zero_grad()` is handed out again on the next backward
//! without pinning anew. [`Arena::empty_cache`] returns pooled memory to the OS. Memory that only
//! the CPU touches (optimizer states) is asked for unpinned ([`Arena::alloc_with`]).
//!
//! Pinning is delegated to a [`Pinner`] (CUDA's `cuMemHostRegister` on a GPU machine, none on a
//! CPU-only one). If the pinner refuses (memlock limit, driver error), the arena keeps going with
//! pageable memory and remembers why, once, for the caller to warn about.

use std::collections::{BTreeMap, HashMap};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, RwLock, Weak};

use rayon::prelude::*;

use crate::error::{Error, Result};

/// Regions at least this large are faulted in by several threads before pinning.
const PARALLEL_TOUCH_BYTES: usize = 64 << 20;

/// Page-locks host memory for fast, asynchronous device copies.
pub trait Pinner: Send + Sync {
    /// Pins `len` bytes at the page-aligned `ptr`.
    ///
    /// # Safety
    /// The range must be a live mapping that stays mapped until [`Pinner::unpin`].
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<()>;
    /// Unpins a range pinned by [`Pinner::pin`].
    ///
    /// # Safety
    /// `ptr` must have been pinned by this pinner and not unpinned since.
    unsafe fn unpin(&self, ptr: *mut u8, len: usize);
}

/// Pins through the CUDA driver (`cuMemHostRegister`, portable to every context).
pub struct CudaPinner(pub crate::cuda::Context);

impl Pinner for CudaPinner {
    unsafe fn pin(&self, ptr: *mut u8, len: usize) -> Result<()> {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.0.register_host(ptr, len) }
    }
    unsafe fn unpin(&self, ptr: *mut u8, _len: usize) {
        // SAFETY: forwarded from the caller's contract. A failure here (driver already torn down
        // at exit) leaves nothing to clean up.
        let _ = unsafe { self.0.unregister_host(ptr) };
    }
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

/// One mapping: what the pool keeps.
struct Block {
    ptr: NonNull<u8>,
    cap: usize,
    pinned: bool,
}

// SAFETY: a Block is plain memory owned by exactly one Region or the pool at a time.
unsafe impl Send for Block {}
// SAFETY: `&Block` only hands out the pointer and plain fields.
unsafe impl Sync for Block {}

/// What keeps a piece of host memory mapped (and out of the pool) while it is referenced.
type Keep = Arc<dyn Send + Sync>;

/// One live piece of host memory the arena knows: its length and a weak reference to its owner.
struct Known {
    len: usize,
    keep: Weak<dyn Send + Sync>,
}

/// Byte counts of an arena, as `ramtorch.stats()` reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ArenaStats {
    /// Bytes mapped, in use or pooled.
    pub reserved_bytes: usize,
    /// Bytes the live regions asked for (exact sizes).
    pub in_use_bytes: usize,
    /// Of `reserved_bytes`, how many are page-locked.
    pub pinned_bytes: usize,
    /// Of `reserved_bytes`, how many are pageable.
    pub pageable_bytes: usize,
    /// Bytes sitting in the pool, ready for reuse.
    pub pooled_bytes: usize,
    /// Live regions.
    pub regions: usize,
}

struct Inner {
    pinner: Option<Box<dyn Pinner>>,
    pin_enabled: AtomicBool,
    pin_warning: Mutex<Option<String>>,
    /// Pooled mappings by (size, pinned).
    pool: Mutex<HashMap<(usize, bool), Vec<Block>>>,
    page: usize,
    reserved: AtomicUsize,
    in_use: AtomicUsize,
    pinned: AtomicUsize,
    pooled: AtomicUsize,
    regions: AtomicUsize,
    /// Live regions (and registered shared regions) by start address, for [`Arena::slice`].
    known: RwLock<BTreeMap<usize, Known>>,
}

impl Inner {
    fn register(&self, start: usize, len: usize, keep: Weak<dyn Send + Sync>) {
        if let Ok(mut k) = self.known.write() {
            k.insert(start, Known { len, keep });
        }
    }

    fn unregister(&self, start: usize) {
        if let Ok(mut k) = self.known.write() {
            k.remove(&start);
        }
    }

    fn map(&self, cap: usize, pin: bool) -> Result<Block> {
        // SAFETY: an anonymous private mapping with no address hint has no preconditions.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::HostAlloc {
                bytes: cap,
                reason: std::io::Error::last_os_error().to_string(),
            });
        }
        let ptr = NonNull::new(p as *mut u8).ok_or(Error::HostAlloc {
            bytes: cap,
            reason: "mmap returned null".into(),
        })?;
        if cap >= PARALLEL_TOUCH_BYTES {
            touch_pages(ptr, cap, self.page, true);
        }
        let mut block = Block {
            ptr,
            cap,
            pinned: false,
        };
        // SAFETY: the mapping was just created and lives until `unmap`.
        block.pinned = pin && unsafe { self.try_pin(ptr.as_ptr(), cap) };
        self.reserved.fetch_add(cap, Ordering::Relaxed);
        if block.pinned {
            self.pinned.fetch_add(cap, Ordering::Relaxed);
        }
        Ok(block)
    }

    /// Pins `len` bytes at `ptr` unless pinning is off or was refused before; on a refusal,
    /// pinning is turned off for good and the reason kept for one warning. Returns whether pinned.
    ///
    /// # Safety
    /// As for [`Pinner::pin`].
    unsafe fn try_pin(&self, ptr: *mut u8, len: usize) -> bool {
        let Some(pinner) = &self.pinner else {
            return false;
        };
        if !self.pin_enabled.load(Ordering::Relaxed) {
            return false;
        }
        // SAFETY: forwarded from the caller's contract.
        match unsafe { pinner.pin(ptr, len) } {
            Ok(()) => true,
            Err(e) => {
                self.pin_enabled.store(false, Ordering::Relaxed);
                if let Ok(mut w) = self.pin_warning.lock() {
                    *w = Some(format!(
                        "page-locking host memory was refused ({e}); ramtorch falls back to \
                         pageable memory: copies to and from the GPU are staged by the driver, \
                         synchronous and typically 2-3x slower (raise `ulimit -l` to fix)"
                    ));
                }
                false
            }
        }
    }

    fn unmap(&self, block: Block) {
        if block.pinned {
            if let Some(pinner) = &self.pinner {
                // SAFETY: the block was pinned by this pinner in `map` and is unpinned once here.
                unsafe { pinner.unpin(block.ptr.as_ptr(), block.cap) };
            }
            self.pinned.fetch_sub(block.cap, Ordering::Relaxed);
        }
        self.reserved.fetch_sub(block.cap, Ordering::Relaxed);
        // SAFETY: the block is a mapping of `cap` bytes made by `map`, unmapped once.
        unsafe {
            libc::munmap(block.ptr.as_ptr() as *mut libc::c_void, block.cap);
        }
    }
}

/// Faults every page of a mapping in, from all cores: by writing zero when the memory is fresh
/// (`write`: anonymous or newly created memory, all zero and seen by nobody else yet), by reading
/// otherwise (memory that already holds data, e.g. a shared region mapped by another process).
pub(crate) fn touch_pages(ptr: NonNull<u8>, cap: usize, page: usize, write: bool) {
    let base = ptr.as_ptr() as usize;
    let chunk = 16 << 20;
    (0..cap.div_ceil(chunk)).into_par_iter().for_each(|c| {
        let start = c * chunk;
        let end = (start + chunk).min(cap);
        let mut off = start;
        while off < end {
            let p = (base + off) as *mut u8;
            if write {
                // SAFETY: `p` lies inside the live, writable mapping of `cap` bytes; the memory is
                // fresh (all zero) and not visible to anyone else, so writing zero changes nothing.
                unsafe { std::ptr::write_volatile(p, 0) };
            } else {
                // SAFETY: `p` lies inside the live, readable mapping of `cap` bytes.
                unsafe { std::ptr::read_volatile(p) };
            }
            off += page;
        }
    });
}

/// A pool of host memory. Cheap to clone (shared).
#[derive(Clone)]
pub struct Arena {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Arena {
    /// An arena that pins with `pinner`, or hands out pageable memory when `None`.
    pub fn new(pinner: Option<Box<dyn Pinner>>) -> Self {
        Self {
            inner: Arc::new(Inner {
                pinner,
                pin_enabled: AtomicBool::new(true),
                pin_warning: Mutex::new(None),
                pool: Mutex::new(HashMap::new()),
                page: page_size(),
                reserved: AtomicUsize::new(0),
                in_use: AtomicUsize::new(0),
                pinned: AtomicUsize::new(0),
                pooled: AtomicUsize::new(0),
                regions: AtomicUsize::new(0),
                known: RwLock::new(BTreeMap::new()),
            }),
        }
    }

    /// Whether this arena tries to pin.
    pub fn pins(&self) -> bool {
        self.inner.pinner.is_some() && self.inner.pin_enabled.load(Ordering::Relaxed)
    }

    /// A region of exactly `len` bytes (the mapping is rounded up to whole pages). With `zeroed`,
    /// its contents are zero; otherwise they are unspecified (a recycled region keeps old bytes).
    pub fn alloc(&self, len: usize, zeroed: bool) -> Result<Region> {
        self.alloc_with(len, zeroed, true)
    }

    /// As [`alloc`](Self::alloc); with `pin` false the memory is never page-locked: for memory
    /// only the CPU touches (optimizer states), which then neither pays the pinning nor counts
    /// against the process's locked-memory limit.
    pub fn alloc_with(&self, len: usize, zeroed: bool, pin: bool) -> Result<Region> {
        let inner = &self.inner;
        let cap = len.max(1).div_ceil(inner.page) * inner.page;
        let pinned = pin && self.pins();
        let recycled = {
            let mut pool = inner
                .pool
                .lock()
                .map_err(|_| Error::Worker("arena pool lock poisoned".into()))?;
            pool.get_mut(&(cap, pinned)).and_then(Vec::pop)
        };
        let block = match recycled {
            Some(b) => {
                inner.pooled.fetch_sub(cap, Ordering::Relaxed);
                if zeroed {
                    // SAFETY: the block is `cap` writable bytes that nobody else references.
                    unsafe { std::ptr::write_bytes(b.ptr.as_ptr(), 0, cap) };
                }
                b
            }
            None => inner.map(cap, pin)?,
        };
        inner.in_use.fetch_add(len, Ordering::Relaxed);
        inner.regions.fetch_add(1, Ordering::Relaxed);
        let start = block.ptr.as_ptr() as usize;
        let mem = Arc::new(Mapping {
            block: Some(block),
            len,
            arena: self.inner.clone(),
        });
        let keep: Keep = mem.clone();
        inner.register(start, len, Arc::downgrade(&keep));
        Ok(Region { mem })
    }

    /// The `len` bytes at `addr`, if they lie inside one live region of this arena or one shared
    /// region registered with it; the result keeps that memory mapped (and out of the pool) for as
    /// long as it lives. Anything else is an [`Error::InvalidArgument`]. An O(log n) lookup under
    /// a read lock held only for the lookup, no allocation.
    pub fn slice(&self, addr: usize, len: usize) -> Result<HostSlice> {
        let outside = || {
            Error::InvalidArgument(format!(
                "host range {addr:#x}..+{len} is not inside memory ramtorch allocated \
                 (a live arena or shared region)"
            ))
        };
        let end = addr.checked_add(len).ok_or_else(outside)?;
        let known = self
            .inner
            .known
            .read()
            .map_err(|_| Error::Worker("arena registry lock poisoned".into()))?;
        let (&start, k) = known.range(..=addr).next_back().ok_or_else(outside)?;
        if end > start + k.len {
            return Err(outside());
        }
        let keep = k.keep.upgrade().ok_or_else(outside)?;
        Ok(HostSlice {
            addr,
            len,
            _keep: Lease { _keep: keep },
        })
    }

    /// Makes [`Arena::slice`] find the `len` bytes at `start` while `keep` is alive.
    pub(crate) fn register_external(&self, start: usize, len: usize, keep: Weak<dyn Send + Sync>) {
        self.inner.register(start, len, keep);
    }

    /// Undoes [`Arena::register_external`]; to be called before the memory is unmapped.
    pub(crate) fn unregister_external(&self, start: usize) {
        self.inner.unregister(start);
    }

    /// Returns every pooled mapping to the OS (unpinning it first).
    pub fn empty_cache(&self) {
        let blocks: Vec<Block> = match self.inner.pool.lock() {
            Ok(mut pool) => pool.drain().flat_map(|(_, v)| v).collect(),
            Err(_) => return,
        };
        for b in blocks {
            self.inner.pooled.fetch_sub(b.cap, Ordering::Relaxed);
            self.inner.unmap(b);
        }
    }

    /// Current byte counts.
    pub fn stats(&self) -> ArenaStats {
        let i = &self.inner;
        let reserved = i.reserved.load(Ordering::Relaxed);
        let pinned = i.pinned.load(Ordering::Relaxed);
        ArenaStats {
            reserved_bytes: reserved,
            in_use_bytes: i.in_use.load(Ordering::Relaxed),
            pinned_bytes: pinned,
            pageable_bytes: reserved.saturating_sub(pinned),
            pooled_bytes: i.pooled.load(Ordering::Relaxed),
            regions: i.regions.load(Ordering::Relaxed),
        }
    }

    /// The reason pinning was refused, the first time it is asked after a refusal.
    pub fn take_pin_warning(&self) -> Option<String> {
        self.inner
            .pin_warning
            .lock()
            .ok()
            .and_then(|mut w| w.take())
    }
}

/// The process-wide arena, made on first use.
static GLOBAL: OnceLock<Arena> = OnceLock::new();
static GLOBAL_INIT: Mutex<()> = Mutex::new(());

/// Whether the environment allows pinning (`RAMTORCH_PIN` is not `0`, `false`, `no` or `off`).
pub fn pinning_wanted() -> bool {
    !matches!(
        std::env::var("RAMTORCH_PIN").as_deref(),
        Ok("0") | Ok("false") | Ok("no") | Ok("off")
    )
}

impl Arena {
    /// The process-wide arena: the one the Python package allocates from. It pins through CUDA
    /// (device 0's primary context) when a CUDA device is present and [`pinning_wanted`]; it hands
    /// out pageable memory otherwise. Made on the first call; later calls return it.
    pub fn global() -> Result<&'static Arena> {
        if let Some(a) = GLOBAL.get() {
            return Ok(a);
        }
        let _init = GLOBAL_INIT
            .lock()
            .map_err(|_| Error::Worker("arena init lock poisoned".into()))?;
        if let Some(a) = GLOBAL.get() {
            return Ok(a);
        }
        let pinner: Option<Box<dyn Pinner>> =
            if pinning_wanted() && crate::cuda::device_count()? > 0 {
                Some(Box::new(CudaPinner(crate::cuda::Context::new(0)?)))
            } else {
                None
            };
        Ok(GLOBAL.get_or_init(|| Arena::new(pinner)))
    }
}

impl Arena {
    /// Pins `len` bytes at `ptr`, memory this arena did not map (a [`crate::shared::SharedRegion`]),
    /// with this arena's pinner. Returns whether the range is now pinned: `false` without a pinner,
    /// after an earlier refusal, or on a refusal, which turns pinning off and leaves the one-time
    /// warning exactly as for arena regions. The arena's byte counts are not affected.
    ///
    /// # Safety
    /// `ptr` must be page-aligned and `len` bytes from it a live mapping that stays mapped until
    /// [`Arena::unpin_external`] is called on it.
    pub unsafe fn pin_external(&self, ptr: *mut u8, len: usize) -> bool {
        // SAFETY: forwarded from the caller's contract.
        unsafe { self.inner.try_pin(ptr, len) }
    }

    /// Unpins a range pinned by [`Arena::pin_external`].
    ///
    /// # Safety
    /// `ptr`/`len` must have been pinned by `pin_external` of this arena (it returned `true`) and not
    /// unpinned since.
    pub unsafe fn unpin_external(&self, ptr: *mut u8, len: usize) {
        if let Some(pinner) = &self.inner.pinner {
            // SAFETY: forwarded from the caller's contract.
            unsafe { pinner.unpin(ptr, len) };
        }
    }

    /// The host page size the arena rounds mappings to.
    pub fn page_size(&self) -> usize {
        self.inner.page
    }
}

/// Keeps host memory that the arena knows mapped, and out of the pool, while it lives: what a
/// queued copy or a running kernel holds on the memory it reads or writes.
#[derive(Clone)]
pub struct Lease {
    _keep: Keep,
}

impl std::fmt::Debug for Lease {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Lease")
    }
}

impl Lease {
    pub(crate) fn new(keep: Keep) -> Self {
        Self { _keep: keep }
    }
}

/// A byte range inside a live region (arena or shared), which it keeps alive: obtained from
/// [`Arena::slice`], [`Region::slice`] or [`crate::shared::SharedRegion::slice`], never from a bare
/// address alone, so the range is known to be mapped memory ramtorch owns.
#[derive(Debug, Clone)]
pub struct HostSlice {
    addr: usize,
    len: usize,
    _keep: Lease,
}

impl HostSlice {
    /// Address and length of the `len` bytes at `offset` of `what`, `region_len` bytes at `base`;
    /// an error naming `what` if they reach past its end.
    pub(crate) fn within(
        base: usize,
        region_len: usize,
        offset: usize,
        len: usize,
        what: &str,
    ) -> Result<(usize, usize)> {
        match offset.checked_add(len) {
            Some(end) if end <= region_len => Ok((base + offset, len)),
            _ => Err(Error::InvalidArgument(format!(
                "bytes {offset}..+{len} are outside {what} of {region_len} bytes"
            ))),
        }
    }

    pub(crate) fn new(addr: usize, len: usize, keep: Lease) -> Self {
        Self {
            addr,
            len,
            _keep: keep,
        }
    }
    /// An empty range, which names no memory (copies of it move nothing).
    pub fn empty() -> Self {
        Self::new(0, 0, Lease::new(Arc::new(())))
    }
    /// Start of the range.
    pub fn as_ptr(&self) -> *mut u8 {
        self.addr as *mut u8
    }
    /// Bytes in the range.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the range is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// What keeps the memory alive, to hold on to without the range.
    pub fn lease(&self) -> Lease {
        self._keep.clone()
    }
}

/// The mapping of a region, shared by the region and the leases on it.
struct Mapping {
    block: Option<Block>,
    len: usize,
    arena: Arc<Inner>,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        let Some(block) = self.block.take() else {
            return;
        };
        // Unregistered before the block can be handed out again or unmapped.
        self.arena.unregister(block.ptr.as_ptr() as usize);
        self.arena.in_use.fetch_sub(self.len, Ordering::Relaxed);
        self.arena.regions.fetch_sub(1, Ordering::Relaxed);
        let cap = block.cap;
        match self.arena.pool.lock() {
            Ok(mut pool) => {
                pool.entry((cap, block.pinned)).or_default().push(block);
                self.arena.pooled.fetch_add(cap, Ordering::Relaxed);
            }
            Err(_) => self.arena.unmap(block),
        }
    }
}

/// Host memory of an exact size. When the region and every [`Lease`] on it are dropped, its
/// mapping returns to its arena's pool.
pub struct Region {
    mem: Arc<Mapping>,
}

impl Region {
    /// Start of the region.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem
            .block
            .as_ref()
            .map_or(std::ptr::null_mut(), |b| b.ptr.as_ptr())
    }
    /// Bytes asked for.
    pub fn len(&self) -> usize {
        self.mem.len
    }
    /// Whether the region holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.mem.len == 0
    }
    /// Whether the region is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.mem.block.as_ref().is_some_and(|b| b.pinned)
    }
    /// Keeps the region's memory alive, even after the region itself is dropped.
    pub fn lease(&self) -> Lease {
        Lease::new(self.mem.clone())
    }
    /// The `len` bytes at `offset` of the region, kept alive by the result.
    pub fn slice(&self, offset: usize, len: usize) -> Result<HostSlice> {
        HostSlice::within(self.as_ptr() as usize, self.len(), offset, len, "a region")
            .map(|(addr, len)| HostSlice::new(addr, len, self.lease()))
    }
    /// The bytes, for tests and host-side kernels.
    ///
    /// # Safety
    /// No other code may write the region while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the block is `cap >= len` readable bytes, live while `self` is.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Region({} bytes, pinned: {})",
            self.len(),
            self.is_pinned()
        )
    }
}
