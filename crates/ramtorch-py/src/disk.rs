//! Bindings of the disk tier (`ramtorch_core::disk`): `DiskStore(dir, nbytes, threads)` makes a
//! store file, `mapping()` exports its mapping as a 1-D uint8 CPU tensor (the parameters' host
//! memory), `read(offset, dst, nbytes)` queues a read into ramtorch memory (checked against the
//! arena) and returns a `ReadTicket`, `settle` writes mapped bytes back and drops them from memory.
//! A disk error raises `OSError` with the OS's errno (`ENOSPC` for a full disk), naming the
//! operation and the file.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use ramtorch_core::disk;

use crate::dlpack::{export, Memory};
use crate::{guard, memory};

/// A store file of the disk tier (see `ramtorch_core::disk`).
#[pyclass(module = "ramtorch._core", frozen)]
struct DiskStore {
    inner: disk::DiskStore,
}

#[pymethods]
impl DiskStore {
    /// Makes a store of exactly `nbytes` (zero-filled) in the directory `dir`, allocated whole at
    /// once (a full disk is an `OSError` here), read by `threads` I/O threads. Its name is removed
    /// from `dir` at once: nothing is left there, even after a crash.
    #[new]
    fn new(
        py: Python<'_>,
        dir: std::path::PathBuf,
        nbytes: usize,
        threads: usize,
    ) -> PyResult<Self> {
        let inner = py.detach(|| {
            guard("DiskStore", || {
                disk::DiskStore::create(crate::arena()?, &dir, nbytes, threads)
            })
        })?;
        Ok(Self { inner })
    }

    /// A store kept at `path` (its name stays): made there, exactly `nbytes` zero bytes
    /// allocated whole, with `create` (an existing file is an `OSError`), else opened as it is
    /// (its size must be `nbytes`).
    #[staticmethod]
    fn open(
        py: Python<'_>,
        path: std::path::PathBuf,
        nbytes: usize,
        threads: usize,
        create: bool,
    ) -> PyResult<Self> {
        let inner = py.detach(|| {
            guard("DiskStore.open", || {
                disk::DiskStore::open(crate::arena()?, &path, nbytes, threads, create)
            })
        })?;
        Ok(Self { inner })
    }

    /// Makes everything written to the store so far durable (`msync` of the mapping, then
    /// `fdatasync`).
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| guard("DiskStore.sync", || self.inner.sync()))
    }

    /// The whole mapping, as a DLPack capsule of a 1-D uint8 CPU tensor (which keeps the store
    /// alive).
    fn mapping(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        export(py, Memory::Disk(self.inner.clone()))
    }

    /// Queues a read of the `nbytes` bytes at `offset` into `dst` (a tensor or address inside
    /// ramtorch memory, e.g. a staging buffer from `arena_alloc`); returns its ticket. `cache`:
    /// through the page cache, left there (for a range host code is about to write through the
    /// mapping); otherwise direct where possible, and the range leaves memory after.
    #[pyo3(signature = (dst, offset, nbytes, cache = false))]
    fn read(
        &self,
        dst: &Bound<'_, PyAny>,
        offset: usize,
        nbytes: usize,
        cache: bool,
    ) -> PyResult<ReadTicket> {
        let path = self.inner.path().to_owned();
        guard("DiskStore.read", || {
            let dst = memory::host_slice("dst", dst, nbytes)?;
            let ticket = self.inner.read(offset, &dst, cache)?;
            Ok(ReadTicket { ticket, path })
        })
    }

    /// Writes the mapped pages of the `nbytes` bytes at `offset` back to the file and drops them
    /// from memory (they are read again when touched).
    fn settle(&self, py: Python<'_>, offset: usize, nbytes: usize) -> PyResult<()> {
        py.detach(|| guard("DiskStore.settle", || self.inner.settle(offset, nbytes)))
    }

    /// Queues a write of the `nbytes` bytes of `src` (a tensor or address inside ramtorch
    /// memory) to the file at `offset`, directly where possible; returns its ticket. `src` must
    /// not change until the ticket is done.
    fn write(&self, src: &Bound<'_, PyAny>, offset: usize, nbytes: usize) -> PyResult<ReadTicket> {
        let path = self.inner.path().to_owned();
        guard("DiskStore.write", || {
            let src = memory::host_slice("src", src, nbytes)?;
            let ticket = self.inner.write(offset, &src)?;
            Ok(ReadTicket { ticket, path })
        })
    }

    /// As `settle`, on the store's I/O threads: returns a ticket at once (its `wait()` raises
    /// the write-back's error, if it failed).
    fn settle_async(&self, offset: usize, nbytes: usize) -> PyResult<ReadTicket> {
        let path = self.inner.path().to_owned();
        guard("DiskStore.settle_async", || {
            let ticket = self.inner.settle_async(offset, nbytes)?;
            Ok(ReadTicket { ticket, path })
        })
    }

    /// Bytes in the store.
    #[getter]
    fn nbytes(&self) -> usize {
        self.inner.len()
    }

    /// The file's path when it was made.
    #[getter]
    fn path(&self) -> String {
        self.inner.path().to_owned()
    }

    /// Whether reads bypass the page cache (`O_DIRECT`).
    #[getter]
    fn direct(&self) -> bool {
        self.inner.is_direct()
    }

    /// What the store has done: reads, read_bytes, busy_seconds, buffered_chunks, cached_chunks,
    /// settled_bytes, write_busy_seconds.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.stats();
        let d = PyDict::new(py);
        d.set_item("reads", s.reads)?;
        d.set_item("read_bytes", s.read_bytes)?;
        d.set_item("busy_seconds", s.busy_seconds)?;
        d.set_item("buffered_chunks", s.buffered_chunks)?;
        d.set_item("cached_chunks", s.cached_chunks)?;
        d.set_item("settled_bytes", s.settled_bytes)?;
        d.set_item("write_busy_seconds", s.write_busy_seconds)?;
        Ok(d)
    }
}

/// A read queued by `DiskStore.read`.
#[pyclass(module = "ramtorch._core", frozen)]
struct ReadTicket {
    ticket: disk::ReadTicket,
    path: String,
}

#[pymethods]
impl ReadTicket {
    /// Whether the read has ended (`wait` then returns at once, or raises its error).
    fn done(&self) -> bool {
        self.ticket.is_done()
    }

    /// `(queued, ended)` in seconds of the monotonic clock (`time.perf_counter()`'s on Linux), or
    /// `None` while the read runs.
    fn times(&self) -> Option<(f64, f64)> {
        self.ticket.times()
    }

    /// Waits (without the GIL) until the bytes are there; a failed read raises `OSError`. Signals
    /// are answered every 100 ms (Ctrl-C raises `KeyboardInterrupt`; the read goes on and keeps
    /// its buffer alive until it ends).
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        let step = std::time::Duration::from_millis(100);
        loop {
            let done = py.detach(|| {
                guard("DiskStore.read", || {
                    self.ticket.wait_timeout(&self.path, step)
                })
            })?;
            if done {
                return Ok(());
            }
            py.check_signals()?;
        }
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<DiskStore>()?;
    m.add_class::<ReadTicket>()?;
    Ok(())
}
