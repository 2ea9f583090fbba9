//! Host memory mapped once by several processes of one node.
//!
//! A [`SharedRegion`] is a `memfd` (anonymous shared memory, no file system entry) of an exact size,
//! mapped `MAP_SHARED`, faulted in from all cores and pinned through the arena's [`Pinner`]
//! (each process pins its own mapping of the same physical pages). Other local processes of the
//! same user open it by its [name](SharedRegion::name), `/proc/<creator pid>/fd/<fd>`, while the
//! creator is alive, with [`SharedRegion::attach`]. Nothing is ever left in `/dev/shm`: the kernel
//! frees the memory when the last process closes and unmaps it, even after a crash.
//!
//! The size is sealed (`F_SEAL_SHRINK | F_SEAL_GROW`) right after creation, so no process can
//! truncate the file under the others' mappings (which would turn their accesses into `SIGBUS`).
//!
//! [`Pinner`]: crate::arena::Pinner

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::Arc;

use crate::arena::{Arena, HostSlice, Lease};
use crate::error::{Error, Result};

/// Host memory of an exact size shared with other processes of the node. It is registered with its
/// arena while alive, so [`Arena::slice`] finds it; leases on it keep the mapping alive.
pub struct SharedRegion {
    map: Arc<SharedMap>,
}

/// The mapping, shared by the region and the leases on it.
struct SharedMap {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    /// Held open for the region's life: other processes open it through `/proc/<pid>/fd/<fd>`.
    _fd: OwnedFd,
    name: String,
    pinned: bool,
    arena: Arena,
}

// SAFETY: the region is plain memory owned by this value (the mapping) and the kernel (the pages);
// concurrent access to its bytes is the user's business, as for any tensor storage.
unsafe impl Send for SharedMap {}
// SAFETY: as above; `&SharedMap` only hands out the pointer and plain fields.
unsafe impl Sync for SharedMap {}

fn os_err() -> String {
    std::io::Error::last_os_error().to_string()
}

/// Whether `name` has the shape `/proc/<pid>/fd/<fd>`.
fn valid_name(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("/proc/") else {
        return false;
    };
    let parts: Vec<&str> = rest.split('/').collect();
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    parts.len() == 3 && digits(parts[0]) && parts[1] == "fd" && digits(parts[2])
}

impl SharedRegion {
    /// A new shared region of exactly `len` bytes (zero-filled), pinned with `arena`'s pinner when
    /// it pins (pageable otherwise, with the arena's one-time warning on a refusal).
    pub fn create(arena: &Arena, len: usize) -> Result<Self> {
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a shared region must hold at least one byte".into(),
            ));
        }
        let alloc_err = |what: &str| Error::HostAlloc {
            bytes: len,
            reason: format!("{what}: {}", os_err()),
        };
        let size = libc::off_t::try_from(len).map_err(|_| {
            Error::InvalidArgument(format!("shared region of {len} bytes is too large"))
        })?;
        let label = CString::new("ramtorch-shared").map_err(|_| alloc_err("memfd name"))?;
        // SAFETY: `label` is a valid NUL-terminated string; the flags are valid.
        let raw = unsafe {
            libc::memfd_create(label.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
        };
        if raw < 0 {
            return Err(alloc_err("memfd_create"));
        }
        // SAFETY: `raw` is a fresh file descriptor owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `fd` is a valid memfd; `size` is non-negative.
        if unsafe { libc::ftruncate(fd.as_raw_fd(), size) } != 0 {
            return Err(alloc_err("ftruncate"));
        }
        let seals = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;
        // SAFETY: `fd` is a valid memfd created with MFD_ALLOW_SEALING.
        if unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, seals) } != 0 {
            return Err(alloc_err("sealing the memfd"));
        }
        let name = format!("/proc/{}/fd/{}", std::process::id(), fd.as_raw_fd());
        Self::map(arena, fd, name, len, true)
    }

    /// Opens the shared region `name` (as returned by [`SharedRegion::name`] in a live process of
    /// the same user), checks that it holds exactly `len` bytes, maps it and pins this mapping.
    pub fn attach(arena: &Arena, name: &str, len: usize) -> Result<Self> {
        if !valid_name(name) {
            return Err(Error::InvalidArgument(format!(
                "{name:?} is not a shared region name (expected \"/proc/<pid>/fd/<fd>\", as \
                 returned by shared_alloc)"
            )));
        }
        if len == 0 {
            return Err(Error::InvalidArgument(
                "a shared region must hold at least one byte".into(),
            ));
        }
        let path = CString::new(name)
            .map_err(|_| Error::InvalidArgument(format!("{name:?} contains a NUL byte")))?;
        // SAFETY: `path` is a valid NUL-terminated string; the flags are valid.
        let raw = unsafe { libc::open(path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if raw < 0 {
            return Err(Error::InvalidArgument(format!(
                "cannot open shared region {name}: {} (has the creating process exited, or does \
                 it belong to another user?)",
                os_err()
            )));
        }
        // SAFETY: `raw` is a fresh file descriptor owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        // SAFETY: `fd` is a valid descriptor; F_GET_SEALS takes no argument.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        let want = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;
        if seals < 0 || seals & want != want {
            return Err(Error::InvalidArgument(format!(
                "{name} is not a ramtorch shared region (not a size-sealed memfd)"
            )));
        }
        // SAFETY: an all-zero `stat` is a valid value for fstat to overwrite.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is valid and `st` is a writable stat.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(Error::InvalidArgument(format!(
                "cannot stat shared region {name}: {}",
                os_err()
            )));
        }
        if u64::try_from(st.st_size).ok() != u64::try_from(len).ok() {
            return Err(Error::InvalidArgument(format!(
                "shared region {name} holds {} bytes, expected {len}",
                st.st_size
            )));
        }
        Self::map(arena, fd, name.to_owned(), len, false)
    }

    fn map(arena: &Arena, fd: OwnedFd, name: String, len: usize, fresh: bool) -> Result<Self> {
        let page = arena.page_size();
        let cap = len.div_ceil(page) * page;
        // SAFETY: a shared mapping of a file of `len` bytes with no address hint; the last page is
        // partly backed by the file, so every byte of `cap` is accessible.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                cap,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::HostAlloc {
                bytes: cap,
                reason: format!("mmap of shared region {name}: {}", os_err()),
            });
        }
        let ptr = NonNull::new(p as *mut u8).ok_or(Error::HostAlloc {
            bytes: cap,
            reason: "mmap returned null".into(),
        })?;
        crate::arena::touch_pages(ptr, cap, page, fresh);
        // SAFETY: the mapping was just made, is page-aligned and lives until `drop`, which unpins
        // it before unmapping.
        let pinned = unsafe { arena.pin_external(ptr.as_ptr(), cap) };
        let map = Arc::new(SharedMap {
            ptr,
            len,
            cap,
            _fd: fd,
            name,
            pinned,
            arena: arena.clone(),
        });
        let keep: Arc<dyn Send + Sync> = map.clone();
        arena.register_external(ptr.as_ptr() as usize, len, Arc::downgrade(&keep));
        Ok(Self { map })
    }

    /// Start of this process's mapping.
    pub fn as_ptr(&self) -> *mut u8 {
        self.map.ptr.as_ptr()
    }
    /// Bytes of the region.
    pub fn len(&self) -> usize {
        self.map.len
    }
    /// Whether the region holds no bytes (never: a shared region holds at least one).
    pub fn is_empty(&self) -> bool {
        self.map.len == 0
    }
    /// The name other processes attach with: `/proc/<creator pid>/fd/<fd>` (for an attached
    /// region, the name it was attached with).
    pub fn name(&self) -> &str {
        &self.map.name
    }
    /// Whether this process's mapping is page-locked.
    pub fn is_pinned(&self) -> bool {
        self.map.pinned
    }
    /// Keeps this process's mapping alive, even after the region itself is dropped.
    pub fn lease(&self) -> Lease {
        Lease::new(self.map.clone())
    }
    /// The `len` bytes at `offset` of the region, kept alive by the result.
    pub fn slice(&self, offset: usize, len: usize) -> Result<HostSlice> {
        HostSlice::within(
            self.as_ptr() as usize,
            self.len(),
            offset,
            len,
            "a shared region",
        )
        .map(|(addr, len)| HostSlice::new(addr, len, self.lease()))
    }
    /// The bytes, for tests and host-side kernels.
    ///
    /// # Safety
    /// No code, in this process or another, may write the region while the slice lives.
    pub unsafe fn as_slice(&self) -> &[u8] {
        // SAFETY: the mapping is `cap >= len` readable bytes, live while `self` is.
        unsafe { std::slice::from_raw_parts(self.as_ptr(), self.len()) }
    }
}

impl std::fmt::Debug for SharedRegion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SharedRegion({}, {} bytes, pinned: {})",
            self.name(),
            self.len(),
            self.is_pinned()
        )
    }
}

impl Drop for SharedMap {
    fn drop(&mut self) {
        // Unregistered before the address can be mapped again.
        self.arena.unregister_external(self.ptr.as_ptr() as usize);
        if self.pinned {
            // SAFETY: pinned by `pin_external` of this arena in `map`, unpinned once here.
            unsafe { self.arena.unpin_external(self.ptr.as_ptr(), self.cap) };
        }
        // SAFETY: the mapping of `cap` bytes made in `map`, unmapped once here. The fd closes
        // when `self._fd` drops.
        unsafe {
            libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.cap);
        }
    }
}
