//! Processes forked after ramtorch started working. `fork()` copies only the calling thread: the
//! host device's lane threads and rayon's pool are not in the child, and a lock another thread
//! held at the fork stays locked there, so a call that needs them would wait forever. Once
//! [`enter`] has run in a process, a child forked from it refuses every call instead (as torch
//! refuses CUDA in a forked child), and [`in_forked_child`] tells destructors to leave memory
//! that the parent's threads or locks may guard alone.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Once;

use crate::error::{Error, Result};

/// Set by [`enter`]: ramtorch's threads or locks may exist in this process.
static STARTED: AtomicBool = AtomicBool::new(false);
/// Set in a child forked after [`STARTED`] was set.
static FORKED: AtomicBool = AtomicBool::new(false);
static HANDLER: Once = Once::new();

/// Runs in the child right after `fork()`; only atomics, so it is async-signal-safe.
extern "C" fn after_fork_in_child() {
    if STARTED.load(Ordering::SeqCst) {
        FORKED.store(true, Ordering::SeqCst);
    }
}

/// Whether this process is a child forked after ramtorch started in its parent.
pub fn in_forked_child() -> bool {
    FORKED.load(Ordering::SeqCst)
}

/// The error a forked child gets at every call.
pub fn forked_error() -> Error {
    Error::ForkedChild
}

/// Called before any work: an error in a child forked after ramtorch started in its parent; else
/// records that ramtorch has started in this process (a child forked from now on refuses).
pub fn enter() -> Result<()> {
    if in_forked_child() {
        return Err(forked_error());
    }
    if !STARTED.load(Ordering::Relaxed) {
        HANDLER.call_once(|| {
            // SAFETY: registers a handler that only touches atomics; it stays valid for the life
            // of the process (a static function). A failure (ENOMEM) leaves fork unguarded, as
            // before this call, and is not worth refusing the work for.
            unsafe {
                libc::pthread_atfork(None, None, Some(after_fork_in_child));
            }
        });
        STARTED.store(true, Ordering::SeqCst);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_forked_after_enter_refuses_and_the_parent_does_not() {
        enter().unwrap();
        assert!(!in_forked_child());
        // SAFETY: the child only reads atomics and calls `_exit`, which are fork-safe.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            let code = match enter() {
                Err(Error::ForkedChild) if in_forked_child() => 0,
                _ => 1,
            };
            // SAFETY: `_exit` ends the child without running the parent's destructors.
            unsafe { libc::_exit(code) };
        }
        let mut status = 0;
        // SAFETY: waits for the child just forked; `status` is a valid out pointer.
        let waited = unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(waited, pid);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert!(enter().is_ok(), "the parent goes on working");
    }
}
