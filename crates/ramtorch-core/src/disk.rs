//! The disk tier: one store file holding the units that do not fit in host RAM.
//!
//! A [`DiskStore`] is a file of an exact size created in a directory the user names, removed from
//! the directory right after it is opened (the open descriptors keep it; the kernel frees its
//! blocks when the process exits, crashes included), and allocated whole up front (`fallocate`), so
//! a full disk is an error when the store is made, never a `SIGBUS` on a later write.
//!
//! The store is reached two ways:
//! - **Mapped** (`MAP_SHARED`): what host-side code reads and writes (the parameters' host tensors,
//!   `state_dict`, the optimizer). The kernel pages it in on demand and writes it back;
//!   [`DiskStore::settle`] writes a range back and drops it from memory, so mapped bytes do not stay
//!   resident.
//! - **Read ahead** ([`DiskStore::read`]): the bytes of a range land in a host buffer (page-locked
//!   staging from the arena) through positioned reads on a pool of I/O threads, in chunks, many in
//!   flight, with `O_DIRECT` where the file system takes it (not through the page cache), buffered
//!   elsewhere (tmpfs) with the read pages dropped after. A direct read sees the mapped writes: the
//!   kernel writes a range's dirty pages back before reading it directly.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

use crate::arena::{Arena, HostSlice, Lease};
use crate::error::{Error, Result};

/// Bytes per positioned read: large enough for the device's bandwidth, small enough that several
/// are in flight for one unit.
pub const CHUNK: usize = 8 << 20;
/// Offsets, lengths and buffer addresses of direct reads are multiples of this.
pub const ALIGN: usize = 4096;

/// Names store files: unique in this process.
static SERIAL: AtomicUsize = AtomicUsize::new(0);

/// What a store has done so far.
#[derive(Debug, Clone, Copy, Default)]
pub struct DiskStats {
    /// Reads asked for ([`DiskStore::read`] calls).
    pub reads: u64,
    /// Bytes they read.
    pub read_bytes: u64,
    /// Seconds during which at least one read was in flight.
    pub busy_seconds: f64,
    /// Chunks read through the page cache (no `O_DIRECT` on this file system, or a range it
    /// refused).
    pub buffered_chunks: u64,
    /// Chunks read through the page cache and left there (reads with `cache`).
    pub cached_chunks: u64,
    /// Bytes written back by [`DiskStore::settle`] and [`DiskStore::settle_async`].
    pub settled_bytes: u64,
    /// Seconds during which at least one write-back was running.
    pub write_busy_seconds: f64,
}

/// How [`DiskStore::open_file`] opens its file.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Open {
    /// Made new, its name removed at once.
    Temporary,
    /// Made new, its name kept.
    Create,
    /// An existing file, as it is.
    Existing,
}

/// A store file and its mapping (see the module docs). Clones share the store.
#[derive(Clone)]
pub struct DiskStore {
    inner: Arc<Store>,
}

struct Store {
    path: String,
    file: File,
    /// The same file opened with `O_DIRECT`, where the file system allows it.
    direct: Option<File>,
    len: usize,
    map: NonNull<u8>,
    map_len: usize,
    pool: rayon::ThreadPool,
    /// The arena the mapping is registered with (so views of it are ramtorch memory).
    arena: Arena,
    reads: AtomicU64,
    read_bytes: AtomicU64,
    buffered_chunks: AtomicU64,
    cached_chunks: AtomicU64,
    settled_bytes: AtomicU64,
    /// Reads in flight and when the current busy period began; the busy time so far.
    busy: Mutex<(usize, Option<Instant>, f64)>,
    /// The same for write-backs.
    write_busy: Mutex<(usize, Option<Instant>, f64)>,
}

// SAFETY: the mapping is plain memory owned by this value; concurrent access to its bytes is the
// user's business, as for any tensor storage. Everything else is `Send + Sync` on its own.
unsafe impl Send for Store {}
// SAFETY: as above; `&Store` hands out the pointer and synchronised fields only.
unsafe impl Sync for Store {}

fn disk_err(op: impl Into<String>, path: &str, source: std::io::Error) -> Error {
    Error::Disk {
        op: op.into(),
        path: path.to_owned(),
        source,
    }
}

impl DiskStore {
    /// A new store of exactly `len` bytes (zero-filled) in the directory `dir`, read by `threads`
    /// I/O threads. The file's name is gone from `dir` once this returns. The mapping is
    /// registered with `arena` while the store lives, so [`Arena::slice`] finds it (it is never
    /// pinned: copies to a device go through staging buffers).
    pub fn create(arena: &Arena, dir: &Path, len: usize, threads: usize) -> Result<Self> {
        let shown = dir.display().to_string();
        let meta =
            std::fs::metadata(dir).map_err(|e| disk_err("opening the directory", &shown, e))?;
        if !meta.is_dir() {
            return Err(Error::InvalidArgument(format!(
                "disk={shown:?} is not a directory"
            )));
        }
        let name = format!(
            "ramtorch-{}-{}.store",
            std::process::id(),
            SERIAL.fetch_add(1, Ordering::Relaxed)
        );
        Self::open_file(arena, &dir.join(name), len, threads, Open::Temporary)
    }

    /// A store kept at `path`: made there (exactly `len` zero bytes, allocated whole; an existing
    /// file is an error) with `create`, else opened as it is (its length must be `len`). Its name
    /// stays: the file outlives the process.
    pub fn open(
        arena: &Arena,
        path: &Path,
        len: usize,
        threads: usize,
        create: bool,
    ) -> Result<Self> {
        let how = if create { Open::Create } else { Open::Existing };
        Self::open_file(arena, path, len, threads, how)
    }

    fn open_file(
        arena: &Arena,
        path: &Path,
        len: usize,
        threads: usize,
        how: Open,
    ) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a disk store must hold at least one byte".into(),
            ));
        }
        let shown = path.display().to_string();
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(how != Open::Existing)
            .mode(0o600)
            .custom_flags(libc::O_CLOEXEC)
            .open(path)
            .map_err(|e| {
                let op = if how == Open::Existing {
                    "opening"
                } else {
                    "creating"
                };
                disk_err(op, &shown, e)
            })?;
        let direct = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT | libc::O_CLOEXEC)
            .open(path)
            .ok();
        // A temporary store's name is removed now: the descriptors keep the file, and nothing is
        // left behind by a crash.
        let removed = if how == Open::Temporary {
            std::fs::remove_file(path)
        } else {
            Ok(())
        };
        if how == Open::Existing {
            let have = file
                .metadata()
                .map_err(|e| disk_err("reading the size of", &shown, e))?
                .len();
            if have != len as u64 {
                return Err(Error::InvalidArgument(format!(
                    "the store {shown} holds {have} bytes, expected {len}"
                )));
            }
        } else {
            let size = libc::off_t::try_from(len).map_err(|_| {
                Error::InvalidArgument(format!("a store of {len} bytes is too large"))
            })?;
            // SAFETY: `file` is an open, writable regular file; the range is valid.
            let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, size) };
            if rc != 0 {
                let e = std::io::Error::from_raw_os_error(rc);
                let dir = path.parent().unwrap_or(Path::new("."));
                let free = free_bytes(dir)
                    .map(|f| format!(" ({f} bytes free)"))
                    .unwrap_or_default();
                if how == Open::Create {
                    let _ = std::fs::remove_file(path); // (nothing of it is of use)
                }
                return Err(disk_err(format!("allocating {len} bytes{free}"), &shown, e));
            }
        }
        removed.map_err(|e| disk_err("removing the directory entry", &shown, e))?;
        // SAFETY: a shared mapping of the whole (allocated) file with no address hint.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(disk_err("mapping", &shown, std::io::Error::last_os_error()));
        }
        let map = NonNull::new(p as *mut u8).ok_or_else(|| {
            disk_err(
                "mapping",
                &shown,
                std::io::Error::other("mmap returned null"),
            )
        })?;
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .thread_name(|i| format!("ramtorch-disk-{i}"))
            .build()
            .map_err(|e| Error::Worker(format!("disk reader threads: {e}")))?;
        let inner = Arc::new(Store {
            path: shown,
            file,
            direct,
            len,
            map,
            map_len: len,
            pool,
            arena: arena.clone(),
            reads: AtomicU64::new(0),
            read_bytes: AtomicU64::new(0),
            buffered_chunks: AtomicU64::new(0),
            cached_chunks: AtomicU64::new(0),
            settled_bytes: AtomicU64::new(0),
            busy: Mutex::new((0, None, 0.0)),
            write_busy: Mutex::new((0, None, 0.0)),
        });
        let keep: Arc<dyn Send + Sync> = inner.clone();
        arena.register_external(map.as_ptr() as usize, len, Arc::downgrade(&keep));
        Ok(Self { inner })
    }

    /// Bytes in the store.
    pub fn len(&self) -> usize {
        self.inner.len
    }
    /// Whether the store holds no bytes (never: a store holds at least one).
    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }
    /// The file's path when it was made (its name is removed from the directory at once).
    pub fn path(&self) -> &str {
        &self.inner.path
    }
    /// Whether reads bypass the page cache (`O_DIRECT`).
    pub fn is_direct(&self) -> bool {
        self.inner.direct.is_some()
    }
    /// Start of the mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.inner.map.as_ptr()
    }
    /// Keeps the mapping alive, even after the store itself is dropped.
    pub fn lease(&self) -> Lease {
        Lease::new(self.inner.clone())
    }

    /// Reads the `dst.len()` bytes at `offset` of the store into `dst` on the I/O threads. The
    /// returned ticket says when they are there; `dst` is kept alive until then. With `cache`, the
    /// read goes through the page cache and leaves the bytes there (and in the mapping, if mapped):
    /// for a range host code is about to write through the mapping (an optimizer's update), whose
    /// writes would otherwise fault every page in from the disk first. Otherwise the read is direct
    /// where possible and the range leaves memory after it.
    pub fn read(&self, offset: usize, dst: &HostSlice, cache: bool) -> Result<ReadTicket> {
        let len = dst.len();
        if offset
            .checked_add(len)
            .is_none_or(|end| end > self.inner.len)
        {
            return Err(Error::InvalidArgument(format!(
                "bytes {offset}..+{len} are outside the disk store of {} bytes",
                self.inner.len
            )));
        }
        let parts = chunks(offset, len);
        let ticket = Ticket::new(parts.len(), offset, len, false);
        self.inner.reads.fetch_add(1, Ordering::Relaxed);
        self.inner.begin_busy();
        let base = dst.as_ptr() as usize;
        for (start, n) in parts {
            let store = self.inner.clone();
            let t = ticket.clone();
            let keep = dst.lease();
            self.inner.pool.spawn(move || {
                let r = store.read_chunk(offset + start, base + start, n, cache);
                drop(keep);
                t.finish(r, &store);
            });
        }
        Ok(ReadTicket { ticket })
    }

    /// Writes the mapped pages of the `len` bytes at `offset` back to the file and drops them
    /// from memory: they are read from the file again when touched.
    pub fn settle(&self, offset: usize, len: usize) -> Result<()> {
        let s = &self.inner;
        s.check_range(offset, len)?;
        begin(&s.write_busy);
        let r = s.settle_range(offset, len);
        end(&s.write_busy);
        r.map_err(|e| disk_err(format!("writing back bytes {offset}..+{len}"), &s.path, e))?;
        s.settled_bytes.fetch_add(len as u64, Ordering::Relaxed);
        Ok(())
    }

    /// Makes everything written to the store so far durable: the mapping's dirty pages are
    /// written back (`msync`) and the file's data flushed to the device (`fdatasync`), direct
    /// writes included.
    pub fn sync(&self) -> Result<()> {
        let s = &self.inner;
        // SAFETY: the mapping is ours, `map_len` bytes long, and stays mapped while `s` lives.
        let rc = unsafe { libc::msync(s.map.as_ptr().cast(), s.map_len, libc::MS_SYNC) };
        if rc != 0 {
            return Err(disk_err("msync", &s.path, std::io::Error::last_os_error()));
        }
        s.file
            .sync_data()
            .map_err(|e| disk_err("fdatasync", &s.path, e))
    }

    /// Queues a write of `src` (ramtorch memory) to the file at `offset`, in chunks on the store's
    /// I/O threads, directly (past the page cache) where the file system takes it; returns its
    /// ticket. The range's mapped pages are written back and dropped first (a later access
    /// through the mapping reads what this wrote). `src` must not change until the ticket is done.
    pub fn write(&self, offset: usize, src: &HostSlice) -> Result<ReadTicket> {
        let len = src.len();
        self.inner.check_range(offset, len)?;
        let parts = chunks(offset, len);
        let ticket = Ticket::new(parts.len(), offset, len, true);
        begin(&self.inner.write_busy);
        let base = src.as_ptr() as usize;
        for (start, n) in parts {
            let store = self.inner.clone();
            let t = ticket.clone();
            let keep = src.lease();
            self.inner.pool.spawn(move || {
                let r = store.write_chunk(offset + start, base + start, n);
                drop(keep);
                t.finish(r, &store);
            });
        }
        Ok(ReadTicket { ticket })
    }

    /// As [`settle`](Self::settle), on the store's I/O threads in chunks: returns at once, with a
    /// ticket to wait on (the host code that wrote the range goes on meanwhile).
    pub fn settle_async(&self, offset: usize, len: usize) -> Result<ReadTicket> {
        self.inner.check_range(offset, len)?;
        let parts = chunks(offset, len);
        let ticket = Ticket::new(parts.len(), offset, len, true);
        begin(&self.inner.write_busy);
        for (start, n) in parts {
            let store = self.inner.clone();
            let t = ticket.clone();
            self.inner.pool.spawn(move || {
                let r = store.settle_range(offset + start, n);
                t.finish(r, &store);
            });
        }
        Ok(ReadTicket { ticket })
    }

    /// What the store has done so far.
    pub fn stats(&self) -> DiskStats {
        let s = &self.inner;
        let busy = busy_so_far(&s.busy);
        DiskStats {
            reads: s.reads.load(Ordering::Relaxed),
            read_bytes: s.read_bytes.load(Ordering::Relaxed),
            busy_seconds: busy,
            write_busy_seconds: busy_so_far(&s.write_busy),
            buffered_chunks: s.buffered_chunks.load(Ordering::Relaxed),
            cached_chunks: s.cached_chunks.load(Ordering::Relaxed),
            settled_bytes: s.settled_bytes.load(Ordering::Relaxed),
        }
    }
}

impl std::fmt::Debug for DiskStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DiskStore({}, {} bytes, direct: {})",
            self.path(),
            self.len(),
            self.is_direct()
        )
    }
}

/// Bytes free for an unprivileged user in the file system of `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero statvfs is a valid value for statvfs to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a valid NUL-terminated path and `st` a writable statvfs.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

impl Store {
    fn check_range(&self, offset: usize, len: usize) -> Result<()> {
        offset
            .checked_add(len)
            .filter(|&e| e <= self.len)
            .map(|_| ())
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "bytes {offset}..+{len} are outside the disk store of {} bytes",
                    self.len
                ))
            })
    }

    /// msync of the pages of `offset..offset+len` (inside the store), then drops them.
    fn settle_range(&self, offset: usize, len: usize) -> std::io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        let page = ALIGN;
        let lo = offset / page * page;
        let hi = (offset + len).div_ceil(page) * page;
        let hi = hi.min(self.map_len.div_ceil(page) * page);
        // SAFETY: `lo..hi` lies inside the mapping (page-rounded), which is live while `self` is.
        let rc = unsafe {
            libc::msync(
                self.map.as_ptr().add(lo) as *mut libc::c_void,
                hi - lo,
                libc::MS_SYNC,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        self.drop_cached(lo, hi - lo);
        Ok(())
    }

    fn begin_busy(&self) {
        begin(&self.busy);
    }

    fn end_busy(&self) {
        end(&self.busy);
    }

    /// Reads `n` bytes at file offset `off` into the memory at `addr`, directly when everything
    /// is aligned and the file system takes it, else through the page cache (dropped after).
    fn read_chunk(&self, off: usize, addr: usize, n: usize, cache: bool) -> std::io::Result<()> {
        // SAFETY: `addr..addr+n` lies inside the destination slice, whose lease the caller holds
        // for the duration of this call; nothing else writes it while the read is queued (the
        // ticket is not done).
        let buf = unsafe { std::slice::from_raw_parts_mut(addr as *mut u8, n) };
        let aligned =
            off.is_multiple_of(ALIGN) && n.is_multiple_of(ALIGN) && addr.is_multiple_of(ALIGN);
        if cache {
            self.cached_chunks.fetch_add(1, Ordering::Relaxed);
            return read_exact_at(&self.file, buf, off);
        }
        if let (Some(direct), true) = (&self.direct, aligned) {
            match read_exact_at(direct, buf, off) {
                Ok(()) => {
                    self.drop_cached(off, n);
                    return Ok(());
                }
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            }
        }
        self.buffered_chunks.fetch_add(1, Ordering::Relaxed);
        read_exact_at(&self.file, buf, off)?;
        self.drop_cached(off, n);
        Ok(())
    }

    /// Writes the `n` bytes at `addr` to file offset `off`: the range's mapped pages written back
    /// and dropped first, then directly when everything is aligned and the file system takes it,
    /// else through the page cache (dropped after).
    fn write_chunk(&self, off: usize, addr: usize, n: usize) -> std::io::Result<()> {
        self.settle_range(off, n)?;
        // SAFETY: `addr..addr+n` lies inside the source slice, whose lease the caller holds for
        // the duration of this call; its owner does not write it while the write is queued.
        let buf = unsafe { std::slice::from_raw_parts(addr as *const u8, n) };
        let aligned =
            off.is_multiple_of(ALIGN) && n.is_multiple_of(ALIGN) && addr.is_multiple_of(ALIGN);
        if let (Some(direct), true) = (&self.direct, aligned) {
            match direct.write_all_at(buf, off as u64) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {}
                Err(e) => return Err(e),
            }
        }
        self.file.write_all_at(buf, off as u64)?;
        self.settle_range(off, n)
    }

    /// Drops the file's bytes `off..off+n` from memory once they have been read: the mapped
    /// pages (what host-side writers such as an optimizer touched, written back by the read
    /// before it began) and the page cache. They are read from the file again when touched.
    fn drop_cached(&self, off: usize, n: usize) {
        let lo = off / ALIGN * ALIGN;
        let hi = (off + n).min(self.map_len);
        if hi <= lo {
            return;
        }
        // SAFETY: `lo..hi` lies inside the mapping, live while `self` is; dropping a shared file
        // mapping's pages loses nothing (a dirty page is written back first, or kept dirty in the
        // page cache), and the page cache hint touches no memory.
        unsafe {
            libc::madvise(
                self.map.as_ptr().add(lo) as *mut libc::c_void,
                hi - lo,
                libc::MADV_DONTNEED,
            );
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                lo as libc::off_t,
                (hi - lo) as libc::off_t,
                libc::POSIX_FADV_DONTNEED,
            );
        }
    }
}

/// A busy clock: operations in flight, when the current busy period began, the busy seconds
/// before it.
type Busy = Mutex<(usize, Option<Instant>, f64)>;

fn begin(b: &Busy) {
    if let Ok(mut b) = b.lock() {
        if b.0 == 0 {
            b.1 = Some(Instant::now());
        }
        b.0 += 1;
    }
}

fn end(b: &Busy) {
    if let Ok(mut b) = b.lock() {
        b.0 = b.0.saturating_sub(1);
        if b.0 == 0 {
            if let Some(t) = b.1.take() {
                b.2 += t.elapsed().as_secs_f64();
            }
        }
    }
}

fn busy_so_far(b: &Busy) -> f64 {
    match b.lock() {
        Ok(b) => b.2 + b.1.map_or(0.0, |t| t.elapsed().as_secs_f64()),
        Err(_) => 0.0,
    }
}

/// The pieces `(start, len)` (relative to `offset`) of the `len` bytes at `offset`, cut at the
/// file's multiples of [`CHUNK`]: a large folio of the page cache (naturally aligned, at most a
/// chunk) then lies in one piece, and is dropped whole after it. At least one piece.
fn chunks(offset: usize, len: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(len / CHUNK + 2);
    let end = offset + len;
    let mut at = offset;
    while at < end {
        let next = ((at / CHUNK) + 1) * CHUNK;
        let stop = next.min(end);
        out.push((at - offset, stop - at));
        at = stop;
    }
    if out.is_empty() {
        out.push((0, 0));
    }
    out
}

fn read_exact_at(f: &File, mut buf: &mut [u8], mut off: usize) -> std::io::Result<()> {
    while !buf.is_empty() {
        match f.read_at(buf, off as u64) {
            Ok(0) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the store file ended early",
                ))
            }
            Ok(k) => {
                buf = &mut buf[k..];
                off += k;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Drop for Store {
    fn drop(&mut self) {
        // Unregistered before the address can be mapped again.
        self.arena.unregister_external(self.map.as_ptr() as usize);
        // SAFETY: the mapping of `map_len` bytes made in `create`, unmapped once here; every
        // reference to it (exported tensors, queued reads) holds this value alive.
        unsafe {
            libc::munmap(self.map.as_ptr() as *mut libc::c_void, self.map_len);
        }
    }
}

struct TicketState {
    remaining: usize,
    error: Option<std::io::Error>,
    /// When the last chunk ended (see [`monotonic_seconds`]).
    ended: Option<f64>,
}

struct Ticket {
    state: Mutex<TicketState>,
    done: Condvar,
    bytes: usize,
    offset: usize,
    /// A write-back ([`DiskStore::settle_async`]), not a read.
    write: bool,
    /// When the read was queued (see [`monotonic_seconds`]).
    started: f64,
}

/// Seconds on the system's monotonic clock (`CLOCK_MONOTONIC`): the clock of Python's
/// `time.perf_counter()` and `time.monotonic()` on Linux, so read times line up with host spans.
pub fn monotonic_seconds() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a writable timespec; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

impl Ticket {
    fn new(chunks: usize, offset: usize, bytes: usize, write: bool) -> Arc<Self> {
        Arc::new(Ticket {
            state: Mutex::new(TicketState {
                remaining: chunks,
                error: None,
                ended: None,
            }),
            done: Condvar::new(),
            bytes,
            offset,
            write,
            started: monotonic_seconds(),
        })
    }

    fn finish(&self, r: std::io::Result<()>, store: &Store) {
        let last = match self.state.lock() {
            Ok(mut s) => {
                if let Err(e) = r {
                    s.error.get_or_insert(e);
                }
                s.remaining = s.remaining.saturating_sub(1);
                if s.remaining == 0 {
                    s.ended = Some(monotonic_seconds());
                }
                s.remaining == 0
            }
            Err(_) => true,
        };
        if last {
            if self.write {
                store
                    .settled_bytes
                    .fetch_add(self.bytes as u64, Ordering::Relaxed);
                end(&store.write_busy);
            } else {
                store
                    .read_bytes
                    .fetch_add(self.bytes as u64, Ordering::Relaxed);
                store.end_busy();
            }
            self.done.notify_all();
        }
    }
}

/// A read queued by [`DiskStore::read`].
pub struct ReadTicket {
    ticket: Arc<Ticket>,
}

impl ReadTicket {
    /// Whether every byte has been read (or the read failed: [`wait`](Self::wait) says which).
    pub fn is_done(&self) -> bool {
        self.ticket.state.lock().map_or(true, |s| s.remaining == 0)
    }

    /// When the read was queued and when it ended, in [`monotonic_seconds`] (`None` while it runs).
    pub fn times(&self) -> Option<(f64, f64)> {
        let end = self.ticket.state.lock().ok()?.ended?;
        Some((self.ticket.started, end))
    }

    /// Waits until every byte has been read; an error names the range and the file.
    pub fn wait(&self, path: &str) -> Result<()> {
        while !self.wait_timeout(path, std::time::Duration::from_secs(3600))? {}
        Ok(())
    }

    /// Waits at most `timeout` for the read: `Ok(true)` once every byte is there, `Ok(false)` if
    /// it still runs (a caller that must answer signals waits in steps); an error names the range
    /// and the file.
    pub fn wait_timeout(&self, path: &str, timeout: std::time::Duration) -> Result<bool> {
        let t = &self.ticket;
        let poisoned = || Error::Worker("disk read lock poisoned".into());
        let deadline = Instant::now() + timeout;
        let mut s = t.state.lock().map_err(|_| poisoned())?;
        while s.remaining > 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(false);
            }
            s = t.done.wait_timeout(s, left).map_err(|_| poisoned())?.0;
        }
        match s.error.as_ref() {
            None => Ok(true),
            // (The error stays with the ticket: every wait reports it.)
            Some(e) => Err(disk_err(
                format!(
                    "{} bytes {}..+{}",
                    if t.write { "writing back" } else { "reading" },
                    t.offset,
                    t.bytes
                ),
                path,
                match e.raw_os_error() {
                    Some(code) => std::io::Error::from_raw_os_error(code),
                    None => std::io::Error::new(e.kind(), e.to_string()),
                },
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arena::Arena;

    fn tmp() -> std::path::PathBuf {
        std::env::temp_dir()
    }

    #[test]
    fn reads_what_the_mapping_wrote() {
        let len = 3 * CHUNK + 5 * ALIGN;
        let store = DiskStore::create(&Arena::new(None), &tmp(), len, 4).unwrap();
        // SAFETY: the mapping is `len` writable bytes; nothing else uses it.
        let map = unsafe { std::slice::from_raw_parts_mut(store.as_ptr(), len) };
        for (i, b) in map.iter_mut().enumerate() {
            *b = (i * 31 % 251) as u8;
        }
        store.settle(0, len).unwrap();
        let arena = Arena::new(None);
        for (off, n) in [(0, len), (ALIGN, 2 * CHUNK), (100, 12345), (len - 7, 7)] {
            let dst = arena.alloc(n, true).unwrap();
            let t = store
                .read(off, &dst.slice(0, n).unwrap(), off == 0)
                .unwrap();
            t.wait(store.path()).unwrap();
            assert!(t.is_done());
            let (t0, t1) = t.times().unwrap();
            assert!(t0 <= t1 && t1 <= monotonic_seconds());
            // SAFETY: the read is done; nothing else writes `dst`.
            let got = unsafe { dst.as_slice() };
            assert_eq!(got, &map[off..off + n], "bytes {off}..+{n}");
        }
        let s = store.stats();
        assert_eq!(s.reads, 4);
        assert_eq!(s.read_bytes as usize, len + 2 * CHUNK + 12345 + 7);
        assert!(s.busy_seconds >= 0.0);
    }

    #[test]
    fn a_direct_read_sees_unsettled_writes() {
        let store = DiskStore::create(&Arena::new(None), &tmp(), 2 * ALIGN, 2).unwrap();
        // SAFETY: the mapping is 2 pages, written by this thread only.
        unsafe { std::ptr::write_bytes(store.as_ptr(), 7, 2 * ALIGN) };
        let arena = Arena::new(None);
        let dst = arena.alloc(2 * ALIGN, true).unwrap();
        store
            .read(0, &dst.slice(0, 2 * ALIGN).unwrap(), false)
            .unwrap()
            .wait(store.path())
            .unwrap();
        // SAFETY: the read is done.
        assert!(unsafe { dst.as_slice() }.iter().all(|&b| b == 7));
        // The written pages left memory with the read (they are on the file now).
        let mut resident = [0u8; 2];
        // SAFETY: the mapping is 2 pages at a page-aligned address; `resident` has one byte each.
        let rc = unsafe {
            libc::mincore(
                store.as_ptr() as *mut libc::c_void,
                2 * ALIGN,
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        assert_eq!(resident, [0, 0]);
        // SAFETY: as above (reading the mapping faults the pages in from the file).
        assert!(
            unsafe { std::slice::from_raw_parts(store.as_ptr(), 2 * ALIGN) }
                .iter()
                .all(|&b| b == 7)
        );
    }

    #[test]
    fn an_asynchronous_settle_writes_back_and_drops_the_pages() {
        let len = 2 * CHUNK + 3 * ALIGN;
        let store = DiskStore::create(&Arena::new(None), &tmp(), len, 3).unwrap();
        // SAFETY: the mapping is `len` bytes, written by this thread only.
        unsafe { std::ptr::write_bytes(store.as_ptr(), 9, len) };
        let t = store.settle_async(ALIGN, len - ALIGN).unwrap();
        t.wait(store.path()).unwrap();
        assert!(t.is_done());
        assert_eq!(store.stats().settled_bytes as usize, len - ALIGN);
        assert!(store.stats().write_busy_seconds > 0.0);
        let mut resident = vec![0u8; len / ALIGN];
        // SAFETY: the mapping is `len` bytes at a page-aligned address; one byte a page.
        let rc = unsafe {
            libc::mincore(
                store.as_ptr() as *mut libc::c_void,
                len,
                resident.as_mut_ptr(),
            )
        };
        assert_eq!(rc, 0);
        let kept: Vec<usize> = (1..resident.len())
            .filter(|&i| resident[i] & 1 != 0)
            .collect();
        assert!(kept.is_empty(), "{kept:?} of {}", resident.len());
        let arena = Arena::new(None);
        let dst = arena.alloc(len, true).unwrap();
        store
            .read(0, &dst.slice(0, len).unwrap(), false)
            .unwrap()
            .wait(store.path())
            .unwrap();
        // SAFETY: the read is done.
        assert!(unsafe { dst.as_slice() }.iter().all(|&b| b == 9));
    }

    #[test]
    fn a_write_lands_in_the_file_and_the_mapping_sees_it() {
        let len = CHUNK + 5 * ALIGN;
        let store = DiskStore::create(&Arena::new(None), &tmp(), len + ALIGN, 3).unwrap();
        // SAFETY: the mapping is `len + ALIGN` bytes, written by this thread only (dirty pages the
        // write must not be overwritten by later).
        unsafe { std::ptr::write_bytes(store.as_ptr(), 1, len + ALIGN) };
        let arena = Arena::new(None);
        let src = arena.alloc(len, true).unwrap();
        // SAFETY: `src` is ours; nothing else touches it yet.
        unsafe { std::ptr::write_bytes(src.as_ptr(), 5, len) };
        let t = store.write(ALIGN, &src.slice(0, len).unwrap()).unwrap();
        t.wait(store.path()).unwrap();
        // SAFETY: the write is done; the mapping reads the file (its pages were dropped).
        let seen = unsafe { std::slice::from_raw_parts(store.as_ptr(), len + ALIGN) };
        assert!(seen[..ALIGN].iter().all(|&b| b == 1));
        assert!(seen[ALIGN..].iter().all(|&b| b == 5));
        let dst = arena.alloc(len, true).unwrap();
        store
            .read(ALIGN, &dst.slice(0, len).unwrap(), false)
            .unwrap()
            .wait(store.path())
            .unwrap();
        // SAFETY: the read is done.
        assert!(unsafe { dst.as_slice() }.iter().all(|&b| b == 5));
        assert!(store.write(2 * ALIGN, &dst.slice(0, len).unwrap()).is_err());
    }

    #[test]
    fn a_kept_store_keeps_its_name_and_bytes() {
        let arena = Arena::new(None);
        let path = tmp().join(format!("ramtorch-kept-{}.bin", std::process::id()));
        let _ = std::fs::remove_file(&path);
        {
            let store = DiskStore::open(&arena, &path, 2 * ALIGN, 1, true).unwrap();
            // SAFETY: the mapping is 2 * ALIGN bytes long and nothing else uses it.
            unsafe { std::ptr::write_bytes(store.as_ptr().add(ALIGN), 7, ALIGN) };
            store.sync().unwrap();
            assert!(DiskStore::open(&arena, &path, 2 * ALIGN, 1, true).is_err());
            // exists
        }
        assert!(path.exists());
        assert!(DiskStore::open(&arena, &path, ALIGN, 1, false).is_err()); // another size
        let store = DiskStore::open(&arena, &path, 2 * ALIGN, 1, false).unwrap();
        // SAFETY: as above; the bytes are the file's.
        let bytes = unsafe { std::slice::from_raw_parts(store.as_ptr(), 2 * ALIGN) };
        assert!(bytes[..ALIGN].iter().all(|&b| b == 0));
        assert!(bytes[ALIGN..].iter().all(|&b| b == 7));
        drop(store);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn refuses_bad_ranges_and_places() {
        let store = DiskStore::create(&Arena::new(None), &tmp(), ALIGN, 1).unwrap();
        let arena = Arena::new(None);
        let dst = arena.alloc(2 * ALIGN, true).unwrap();
        assert!(matches!(
            store.read(0, &dst.slice(0, 2 * ALIGN).unwrap(), false),
            Err(Error::InvalidArgument(_))
        ));
        assert!(store.settle(ALIGN, 1).is_err());
        assert!(store.settle_async(1, ALIGN).is_err());
        assert!(DiskStore::create(&Arena::new(None), &tmp(), 0, 1).is_err());
        let file = tmp().join(format!("ramtorch-not-a-dir-{}", std::process::id()));
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            DiskStore::create(&Arena::new(None), &file, ALIGN, 1),
            Err(Error::InvalidArgument(_))
        ));
        std::fs::remove_file(&file).unwrap();
        assert!(matches!(
            DiskStore::create(
                &Arena::new(None),
                Path::new("/nonexistent/ramtorch"),
                ALIGN,
                1
            ),
            Err(Error::Disk { .. })
        ));
    }

    #[test]
    fn a_failed_read_is_an_error_naming_the_range_and_the_file() {
        let store = DiskStore::create(&Arena::new(None), &tmp(), 4 * ALIGN, 2).unwrap();
        // The file shrinks under the store (what a failing disk looks like to a read: the bytes
        // are not there). The mapping past the end is not touched.
        store.inner.file.set_len(ALIGN as u64).unwrap();
        let arena = Arena::new(None);
        let dst = arena.alloc(4 * ALIGN, true).unwrap();
        let t = store
            .read(0, &dst.slice(0, 4 * ALIGN).unwrap(), false)
            .unwrap();
        match t.wait(store.path()) {
            Err(Error::Disk { op, path, .. }) => {
                assert!(op.contains("reading bytes 0..+16384"), "{op}");
                assert_eq!(path, store.path());
            }
            other => panic!("expected a disk error, got {other:?}"),
        }
        assert!(t.is_done());
        assert!(
            t.wait(store.path()).is_err(),
            "a second wait reports the error too"
        );
        assert!(t
            .wait_timeout(store.path(), std::time::Duration::ZERO)
            .is_err());
    }

    #[test]
    fn leaves_nothing_in_the_directory() {
        let dir = tmp().join(format!("ramtorch-disk-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let store = DiskStore::create(&Arena::new(None), &dir, ALIGN, 1).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        drop(store);
        std::fs::remove_dir(&dir).unwrap();
    }
}
