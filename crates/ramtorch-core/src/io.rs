//! Reading `.safetensors` checkpoints straight into host memory.
//!
//! A file is opened once ([`SafetensorsFile::open`]); its header is read with positioned reads of
//! that open file and validated twice: by our own checks ([`parse`]), which give messages naming
//! the file and the tensor, and by the `safetensors` crate's own rules. Nothing is allocated from a
//! size read in the file before that size has been checked against the file's length; a file that
//! breaks any rule is an [`Error::InvalidArgument`], never a panic.
//!
//! [`SafetensorsFile::copy_many`] then copies tensors into a caller's buffers, converting among
//! F32, BF16 and F16 on the way (any dtype may be copied unchanged), on all cores.
//!
//! The file is never memory-mapped: every byte is read with positioned reads of the one open file,
//! so a file cut short by another process meanwhile is an error, not a crash (SIGBUS), and a file
//! renamed over the path after opening is not seen.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use half::slice::HalfFloatSliceExt;
use half::{bf16, f16};

use crate::optim::precision::{bf16_rne, bf16_to_f32};
use rayon::prelude::*;
use serde_json::Value;

pub use safetensors::Dtype;

use crate::error::{Error, Result};

/// Longest header accepted, as the `safetensors` crate: 100 MiB.
pub const MAX_HEADER_BYTES: usize = 100 * 1024 * 1024;
/// Most dimensions a tensor may have.
pub const MAX_NDIM: usize = 64;
/// Most bytes of the destination one piece of a copy writes (the unit of parallel work).
const PIECE_BYTES: usize = 1 << 20;
/// Most bytes of the file one piece of a conversion reads: the buffer a core reads into stays in
/// its L2 cache.
const CONVERT_BYTES: usize = 256 << 10;

/// One tensor to copy with [`SafetensorsFile::copy_many`].
pub struct CopyJob<'a> {
    /// The tensor's name in the file.
    pub name: &'a str,
    /// Where it goes: exactly the tensor's bytes once converted to `dtype`.
    pub dst: &'a mut [u8],
    /// The destination's element type: the tensor's own, or among F32, BF16 and F16.
    pub dtype: Dtype,
}

/// A part of a [`CopyJob`] that one thread does.
struct Piece<'a> {
    name: &'a str,
    dst: &'a mut [u8],
    /// Where its source bytes start in the file.
    offset: usize,
    conv: Option<(Float, Float)>,
}

/// One tensor of a file, as validated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name in the file.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
    /// Number of elements (product of the shape).
    pub numel: usize,
    /// Start of the tensor's bytes, counted from the start of the file.
    pub start: usize,
    /// End (exclusive) of the tensor's bytes, counted from the start of the file.
    pub end: usize,
}

impl TensorInfo {
    /// Bytes of the tensor in the file.
    pub fn nbytes(&self) -> usize {
        self.end - self.start
    }
}

/// A validated header: tensors in file order, the free-form metadata, where the data begins.
#[derive(Debug, Clone)]
pub struct Header {
    /// Tensors sorted by their offset in the file.
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` map, if any.
    pub metadata: Option<HashMap<String, String>>,
    /// Offset of the data section in the file (8 + header length).
    pub data_start: usize,
}

/// The dtype named `s` as in safetensors headers (`"F32"`, `"BF16"`, `"I64"`, ...).
pub fn parse_dtype(s: &str) -> Result<Dtype> {
    serde_json::from_value::<Dtype>(Value::String(s.to_owned()))
        .map_err(|_| Error::InvalidArgument(format!("unknown safetensors dtype {s:?}")))
}

fn bad(what: &str, msg: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("{what}: {msg}"))
}

fn bad_tensor(what: &str, name: &str, msg: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("{what}: tensor {name:?}: {msg}"))
}

/// Parses and validates a whole safetensors file held in `bytes`; `what` names it in errors.
///
/// Checks: the header length is at most [`MAX_HEADER_BYTES`] and inside the file; the header is
/// UTF-8 JSON of the safetensors layout; every tensor has a known dtype, at most [`MAX_NDIM`]
/// dimensions, a shape whose element and byte counts do not overflow, a byte range inside the data
/// section whose length is exactly that byte count; no two ranges overlap. Then the `safetensors`
/// crate's own rules must accept the header too (they also require the ranges to tile the data
/// section exactly).
pub fn parse(bytes: &[u8], what: &str) -> Result<Header> {
    let n = header_len(bytes.get(..8), bytes.len(), what)?;
    parse_header(&bytes[8..8 + n], bytes.len(), what)
}

/// The header length that a file of `file_len` bytes starts with (`len_bytes`: its first 8 bytes,
/// `None` if it is shorter), checked to be at most [`MAX_HEADER_BYTES`] and inside the file.
fn header_len(len_bytes: Option<&[u8]>, file_len: usize, what: &str) -> Result<usize> {
    let Some(len_bytes) = len_bytes.and_then(|b| <[u8; 8]>::try_from(b).ok()) else {
        return Err(bad(
            what,
            format_args!("truncated: {file_len} bytes, shorter than the 8-byte header length"),
        ));
    };
    let n = u64::from_le_bytes(len_bytes);
    if n > MAX_HEADER_BYTES as u64 {
        return Err(bad(
            what,
            format_args!("header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"),
        ));
    }
    let n = n as usize; // ≤ 100 MiB
    if 8 + n > file_len {
        return Err(bad(
            what,
            format_args!(
                "header length {n} runs past the end of the file ({file_len} bytes): truncated or corrupt"
            ),
        ));
    }
    Ok(n)
}

/// Parses and validates `head`, the header (after its 8-byte length) of a safetensors file of
/// `file_len` bytes, as [`parse`].
fn parse_header(head: &[u8], file_len: usize, what: &str) -> Result<Header> {
    let data_start = 8 + head.len();
    let text = std::str::from_utf8(head)
        .map_err(|e| bad(what, format_args!("header is not valid UTF-8 ({e})")))?;
    let root: serde_json::Map<String, Value> = serde_json::from_str(text)
        .map_err(|e| bad(what, format_args!("header is not a JSON object ({e})")))?;
    // A JSON map keeps the last of two equal keys: readers could disagree on which tensor a name
    // means, so a name given twice is refused.
    if top_level_keys(text) != root.len() {
        return Err(bad(what, "a key appears more than once in the header"));
    }
    let data_len = file_len - data_start;

    let mut metadata = None;
    let mut tensors = Vec::with_capacity(root.len());
    for (name, v) in &root {
        if name == "__metadata__" {
            let obj = v
                .as_object()
                .ok_or_else(|| bad(what, "__metadata__ is not an object"))?;
            let mut m = HashMap::with_capacity(obj.len());
            for (k, v) in obj {
                let s = v.as_str().ok_or_else(|| {
                    bad(what, format_args!("__metadata__[{k:?}] is not a string"))
                })?;
                m.insert(k.clone(), s.to_owned());
            }
            metadata = Some(m);
            continue;
        }
        tensors.push(tensor_info(what, name, v, data_start, data_len)?);
    }

    tensors.sort_by_key(|t| (t.start, t.end));
    for w in tensors.windows(2) {
        // Empty tensors occupy no bytes and overlap nothing.
        if w[0].end > w[1].start && w[0].nbytes() > 0 && w[1].nbytes() > 0 {
            return Err(bad(
                what,
                format_args!(
                    "tensors {:?} (bytes {}..{}) and {:?} (bytes {}..{}) overlap",
                    w[0].name,
                    w[0].start - data_start,
                    w[0].end - data_start,
                    w[1].name,
                    w[1].start - data_start,
                    w[1].end - data_start
                ),
            ));
        }
    }

    // Second opinion: the reference reader's rules (contiguous tiling from the start of the data
    // section, its own overflow checks), and the tiling must end where the file does.
    let reference: safetensors::tensor::Metadata = serde_json::from_str(text).map_err(|e| {
        bad(
            what,
            format_args!("rejected by the safetensors reader: {e}"),
        )
    })?;
    let covered = reference
        .tensors()
        .values()
        .map(|t| t.data_offsets.1)
        .max()
        .unwrap_or(0);
    if covered != data_len {
        return Err(bad(
            what,
            format_args!(
                "rejected by the safetensors reader: the tensors cover {covered} bytes of the \
                 {data_len}-byte data section"
            ),
        ));
    }

    Ok(Header {
        tensors,
        metadata,
        data_start,
    })
}

/// How many keys the JSON object `text` (valid JSON, already parsed) has at its top level,
/// counting repeated keys each time.
fn top_level_keys(text: &str) -> usize {
    let (mut depth, mut in_str, mut escaped, mut after_str, mut count) =
        (0usize, false, false, false, 0);
    for &c in text.as_bytes() {
        if in_str {
            if escaped {
                escaped = false;
            } else if c == b'\\' {
                escaped = true;
            } else if c == b'"' {
                in_str = false;
                after_str = depth == 1;
            }
            continue;
        }
        match c {
            b'"' => in_str = true,
            b':' if after_str => {
                count += 1;
                after_str = false;
            }
            b' ' | b'\t' | b'\n' | b'\r' => {}
            b'{' | b'[' => {
                depth += 1;
                after_str = false;
            }
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                after_str = false;
            }
            _ => after_str = false,
        }
    }
    count
}

fn tensor_info(
    what: &str,
    name: &str,
    v: &Value,
    data_start: usize,
    data_len: usize,
) -> Result<TensorInfo> {
    let obj = v
        .as_object()
        .ok_or_else(|| bad_tensor(what, name, "entry is not an object"))?;
    let dtype = obj
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or_else(|| bad_tensor(what, name, "missing or non-string \"dtype\""))?;
    let dtype = parse_dtype(dtype)
        .map_err(|_| bad_tensor(what, name, format_args!("unknown dtype {dtype:?}")))?;
    let shape_v = obj
        .get("shape")
        .and_then(Value::as_array)
        .ok_or_else(|| bad_tensor(what, name, "missing or non-array \"shape\""))?;
    if shape_v.len() > MAX_NDIM {
        return Err(bad_tensor(
            what,
            name,
            format_args!("{} dimensions (at most {MAX_NDIM})", shape_v.len()),
        ));
    }
    let mut shape = Vec::with_capacity(shape_v.len());
    for d in shape_v {
        let d = d
            .as_u64()
            .and_then(|d| usize::try_from(d).ok())
            .ok_or_else(|| bad_tensor(what, name, format_args!("bad dimension {d} in shape")))?;
        shape.push(d);
    }
    let offs = obj
        .get("data_offsets")
        .and_then(Value::as_array)
        .filter(|a| a.len() == 2)
        .ok_or_else(|| bad_tensor(what, name, "\"data_offsets\" is not a pair of integers"))?;
    let off = |i: usize| {
        offs[i]
            .as_u64()
            .and_then(|x| usize::try_from(x).ok())
            .ok_or_else(|| bad_tensor(what, name, format_args!("bad data offset {}", offs[i])))
    };
    let (s, e) = (off(0)?, off(1)?);
    if s > e {
        return Err(bad_tensor(
            what,
            name,
            format_args!("data_offsets [{s}, {e}] end before they start"),
        ));
    }
    if e > data_len {
        return Err(bad_tensor(
            what,
            name,
            format_args!(
                "data_offsets [{s}, {e}] run past the data section ({data_len} bytes): truncated or corrupt"
            ),
        ));
    }
    let numel = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| {
            bad_tensor(
                what,
                name,
                format_args!("shape {shape:?} has more elements than fit in memory"),
            )
        })?;
    let nbits = numel.checked_mul(dtype.bitsize()).ok_or_else(|| {
        bad_tensor(
            what,
            name,
            format_args!("shape {shape:?} of {dtype} overflows a byte count"),
        )
    })?;
    if nbits % 8 != 0 {
        return Err(bad_tensor(
            what,
            name,
            format_args!("shape {shape:?} of {dtype} is not a whole number of bytes"),
        ));
    }
    if nbits / 8 != e - s {
        return Err(bad_tensor(
            what,
            name,
            format_args!(
                "shape {shape:?} of {dtype} needs {} bytes but data_offsets [{s}, {e}] hold {}",
                nbits / 8,
                e - s
            ),
        ));
    }
    Ok(TensorInfo {
        name: name.to_owned(),
        dtype,
        shape,
        numel,
        start: data_start + s,
        end: data_start + e,
    })
}

/// A validated `.safetensors` file, open for positioned reads (never mapped).
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    header: Header,
    index: HashMap<String, usize>,
}

/// Why a file could not be opened: the OS refused, or the file is not valid safetensors.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Opening, inspecting or reading the file failed.
    #[error("cannot open {}: {source}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        source: std::io::Error,
    },
    /// The file is not a valid safetensors file ([`Error::InvalidArgument`]).
    #[error(transparent)]
    Invalid(#[from] Error),
}

/// What kind of non-regular file `t` is, for messages.
fn kind_of(t: &std::fs::FileType) -> &'static str {
    use std::os::unix::fs::FileTypeExt;
    if t.is_dir() {
        "a directory"
    } else if t.is_fifo() {
        "a FIFO"
    } else if t.is_socket() {
        "a socket"
    } else if t.is_char_device() {
        "a character device"
    } else if t.is_block_device() {
        "a block device"
    } else {
        "of an unknown kind"
    }
}

impl SafetensorsFile {
    /// Opens the file at `path` and validates its header (see [`parse`]). Anything but a regular
    /// file is refused, without blocking (a FIFO would otherwise wait for a writer).
    pub fn open(path: impl AsRef<Path>) -> std::result::Result<Self, OpenError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| OpenError::Io {
            path: path.clone(),
            source,
        };
        let what = path.display().to_string();
        // Opened without blocking: opening a FIFO for reading would otherwise wait for a writer,
        // for ever. Only a regular file goes further; it is then read with blocking reads.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&path)
            .map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(bad(
                &what,
                format_args!(
                    "not a regular file ({}): checkpoints are read from regular files only",
                    kind_of(&meta.file_type())
                ),
            )
            .into());
        }
        // SAFETY: `file` owns a valid open descriptor for the duration of both calls; F_GETFL and
        // F_SETFL read and set its status flags and touch no memory of ours.
        unsafe {
            let fd = file.as_raw_fd();
            let flags = libc::fcntl(fd, libc::F_GETFL);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFL, flags & !libc::O_NONBLOCK) < 0 {
                return Err(io(std::io::Error::last_os_error()));
            }
        }
        let Ok(file_len) = usize::try_from(meta.len()) else {
            return Err(bad(&what, "larger than this machine can address").into());
        };
        // The header is read from the open file, as the tensors are later: never mapped.
        let read = |buf: &mut [u8], offset: u64| -> std::result::Result<(), OpenError> {
            use std::os::unix::fs::FileExt;
            file.read_exact_at(buf, offset).map_err(|e| {
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    bad(&what, "cut short while its header was read").into()
                } else {
                    io(e)
                }
            })
        };
        let mut len_bytes = [0u8; 8];
        let len_bytes = if file_len >= 8 {
            read(&mut len_bytes, 0)?;
            Some(&len_bytes[..])
        } else {
            None
        };
        let n = header_len(len_bytes, file_len, &what)?;
        let mut head = vec![0u8; n]; // n ≤ MAX_HEADER_BYTES and inside the file: checked
        read(&mut head, 8)?;
        let header = parse_header(&head, file_len, &what)?;
        drop(head);
        let index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path,
            file,
            header,
            index,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensors in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.header.tensors
    }

    /// The `__metadata__` map, if any.
    pub fn metadata(&self) -> Option<&HashMap<String, String>> {
        self.header.metadata.as_ref()
    }

    /// The tensor called `name`.
    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.index
            .get(name)
            .map(|&i| &self.header.tensors[i])
            .ok_or_else(|| {
                Error::InvalidArgument(format!("{}: no tensor named {name:?}", self.path.display()))
            })
    }

    /// The raw bytes of tensor `name` (in the file's dtype, little-endian), read from the file.
    pub fn read(&self, name: &str) -> Result<Vec<u8>> {
        let t = self.info(name)?;
        let mut buf = vec![0u8; t.nbytes()];
        self.read_at(&mut buf, t.start, &|| {
            format!("{}: tensor {name:?}", self.path.display())
        })?;
        Ok(buf)
    }

    /// Copies tensor `name` into `dst`, converting to `dst_dtype`: any dtype to itself (a plain
    /// copy), or among F32, BF16 and F16. `dst` must hold exactly the converted tensor.
    pub fn copy_tensor(&self, name: &str, dst: &mut [u8], dst_dtype: Dtype) -> Result<()> {
        self.copy_many(vec![CopyJob {
            name,
            dst,
            dtype: dst_dtype,
        }])
    }

    /// Copies several tensors at once, as [`copy_tensor`](Self::copy_tensor) each. Every job is
    /// checked before any byte is written. The work is cut into pieces of at most 1 MiB across
    /// all the jobs, which all cores then read from the page cache (positioned reads: the file's
    /// pages are never mapped into the process, so the resident set stays at the destinations)
    /// and convert in their own cache. Many small or mid-sized tensors keep every core busy,
    /// where one tensor at a time would leave most of them idle.
    pub fn copy_many(&self, jobs: Vec<CopyJob<'_>>) -> Result<()> {
        let mut pieces: Vec<Piece<'_>> = Vec::new();
        for job in jobs {
            let t = self.info(job.name)?;
            let what = || format!("{}: tensor {:?}", self.path.display(), job.name);
            let conv = if t.dtype == job.dtype {
                None
            } else {
                match (Float::of(t.dtype), Float::of(job.dtype)) {
                    (Some(from), Some(to)) => Some((from, to)),
                    _ => {
                        return Err(Error::InvalidArgument(format!(
                            "{}: cannot convert {} to {} (conversions are among F32, BF16 and F16)",
                            what(),
                            t.dtype,
                            job.dtype
                        )))
                    }
                }
            };
            let (ss, ds) = conv.map_or((1, 1), |(f, t)| (f.size(), t.size()));
            let need = (t.nbytes() / ss).checked_mul(ds).ok_or_else(|| {
                Error::InvalidArgument(format!("{}: destination size overflows", what()))
            })?;
            if job.dst.len() != need {
                return Err(Error::InvalidArgument(format!(
                    "{}: destination holds {} bytes, {} of {} needs {need}",
                    what(),
                    job.dst.len(),
                    t.numel,
                    job.dtype
                )));
            }
            // A piece that converts is read into the thread's buffer, which stays in its cache.
            let elems = if conv.is_some() {
                CONVERT_BYTES / ss
            } else {
                PIECE_BYTES
            };
            for (i, dst) in job.dst.chunks_mut(elems * ds).enumerate() {
                pieces.push(Piece {
                    name: job.name,
                    dst,
                    offset: t.start + i * elems * ss,
                    conv,
                });
            }
        }
        pieces
            .into_par_iter()
            .try_for_each_init(Vec::<u32>::new, |buf, p| {
                let what = || format!("{}: tensor {:?}", self.path.display(), p.name);
                let Some((from, to)) = p.conv else {
                    return self.read_at(p.dst, p.offset, &what);
                };
                let n = p.dst.len() / to.size() * from.size();
                buf.resize(n.div_ceil(4), 0);
                let src = &mut as_bytes_mut(buf)[..n];
                self.read_at(src, p.offset, &what)?;
                convert_chunk(src, from, p.dst, to);
                Ok(())
            })
    }

    /// Reads `buf.len()` bytes of the file at `offset` (a file cut short since it was validated
    /// is an error, not a crash).
    fn read_at(&self, buf: &mut [u8], offset: usize, what: &dyn Fn() -> String) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.read_exact_at(buf, offset as u64).map_err(|e| {
            Error::InvalidArgument(format!("{}: reading the file failed: {e}", what()))
        })
    }
}

/// The floating types converted on the fly.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Float {
    F32,
    BF16,
    F16,
}

impl Float {
    fn of(d: Dtype) -> Option<Float> {
        match d {
            Dtype::F32 => Some(Float::F32),
            Dtype::BF16 => Some(Float::BF16),
            Dtype::F16 => Some(Float::F16),
            _ => None,
        }
    }

    fn size(self) -> usize {
        match self {
            Float::F32 => 4,
            Float::BF16 | Float::F16 => 2,
        }
    }
}

#[inline]
fn load16(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

/// bf16 bits of the f32 with bits `x`, rounded to nearest even; NaNs stay NaN (quiet): the
/// crate's shared rounding, bit for bit `half::bf16::from_f32`. Branch-free, so loops over it
/// vectorize.
#[inline]
fn f32_to_bf16_bits(x: u32) -> u16 {
    bf16_rne(f32::from_bits(x)).to_bits()
}

/// f32 bits of the bf16 with bits `x` (exact; NaN payloads kept as they are).
#[inline]
fn bf16_bits_to_f32(x: u16) -> f32 {
    bf16_to_f32(bf16::from_bits(x))
}

/// Plain-old-data element types a byte buffer may be viewed as.
trait Pod: Copy {}
impl Pod for u16 {}
impl Pod for u32 {}
impl Pod for f16 {}
impl Pod for f32 {}

/// `bytes` as a slice of `T`, when aligned for `T` and a whole number of them (little-endian
/// targets only: the file's bytes are little-endian).
fn view<T: Pod>(bytes: &[u8]) -> Option<&[T]> {
    if cfg!(target_endian = "big") {
        return None;
    }
    // SAFETY: `T` is one of the `Pod` types above, for which every bit pattern is a valid value.
    let (pre, mid, post) = unsafe { bytes.align_to::<T>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// As [`view`], mutably.
fn view_mut<T: Pod>(bytes: &mut [u8]) -> Option<&mut [T]> {
    if cfg!(target_endian = "big") {
        return None;
    }
    // SAFETY: as in `view`; any value written through the slice is a valid byte pattern.
    let (pre, mid, post) = unsafe { bytes.align_to_mut::<T>() };
    (pre.is_empty() && post.is_empty()).then_some(mid)
}

/// The bytes of a `u32` buffer.
fn as_bytes_mut(buf: &mut [u32]) -> &mut [u8] {
    // SAFETY: u8 has no alignment requirement and every byte of a u32 is initialized; the
    // length covers exactly the buffer.
    unsafe { std::slice::from_raw_parts_mut(buf.as_mut_ptr().cast::<u8>(), buf.len() * 4) }
}

/// Converts the elements of `src` into `dst`. Aligned buffers take loops over whole elements
/// (vectorized by the compiler, or F16C in `half`); others go byte by byte.
fn convert_chunk(src: &[u8], from: Float, dst: &mut [u8], to: Float) {
    use Float::*;
    match (from, to) {
        (F32, BF16) => {
            if let (Some(s), Some(d)) = (view::<u32>(src), view_mut::<u16>(dst)) {
                for (d, &x) in d.iter_mut().zip(s) {
                    *d = f32_to_bf16_bits(x);
                }
                return;
            }
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let x = u32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&f32_to_bf16_bits(x).to_le_bytes());
            }
        }
        (BF16, F32) => {
            if let (Some(s), Some(d)) = (view::<u16>(src), view_mut::<u32>(dst)) {
                for (d, &x) in d.iter_mut().zip(s) {
                    *d = bf16_bits_to_f32(x).to_bits();
                }
                return;
            }
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                d.copy_from_slice(&bf16_bits_to_f32(load16(s)).to_bits().to_le_bytes());
            }
        }
        (F16, F32) => {
            if let (Some(s), Some(d)) = (view::<f16>(src), view_mut::<f32>(dst)) {
                s.convert_to_f32_slice(d);
                return;
            }
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                d.copy_from_slice(&f16::from_bits(load16(s)).to_f32().to_bits().to_le_bytes());
            }
        }
        (F32, F16) => {
            if let (Some(s), Some(d)) = (view::<f32>(src), view_mut::<f16>(dst)) {
                d.convert_from_f32_slice(s);
                return;
            }
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let x = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        (BF16, F16) => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let x = bf16_bits_to_f32(load16(s));
                d.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        (F16, BF16) => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let x = f16::from_bits(load16(s)).to_f32();
                d.copy_from_slice(&f32_to_bf16_bits(x.to_bits()).to_le_bytes());
            }
        }
        (F32, F32) | (BF16, BF16) | (F16, F16) => dst.copy_from_slice(src),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use safetensors::tensor::TensorView;
    use std::sync::atomic::{AtomicUsize, Ordering};

    static SEQ: AtomicUsize = AtomicUsize::new(0);

    /// A file in the temp dir, removed on drop.
    struct Tmp(PathBuf);
    impl Tmp {
        fn new(bytes: &[u8]) -> Tmp {
            let p = std::env::temp_dir().join(format!(
                "ramtorch-io-test-{}-{}.safetensors",
                std::process::id(),
                SEQ.fetch_add(1, Ordering::Relaxed)
            ));
            std::fs::write(&p, bytes).unwrap();
            Tmp(p)
        }
    }
    impl Drop for Tmp {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn sample() -> Vec<u8> {
        let a = f32_bytes(&[1.0, -2.5, 3.25, 1e-3, 65504.0, -0.0]);
        let b: Vec<u8> = [1.5f32, -7.0, 0.1]
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        let c: Vec<u8> = (0..10i64).flat_map(|x| x.to_le_bytes()).collect();
        let views = vec![
            ("a", TensorView::new(Dtype::F32, vec![2, 3], &a).unwrap()),
            ("b", TensorView::new(Dtype::BF16, vec![3], &b).unwrap()),
            ("c", TensorView::new(Dtype::I64, vec![10], &c).unwrap()),
            (
                "empty",
                TensorView::new(Dtype::F32, vec![0, 4], &[]).unwrap(),
            ),
        ];
        let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::tensor::serialize(views, Some(meta)).unwrap()
    }

    /// A file holding one F32 tensor "w" of `n` elements with bytes `a`.
    fn one_tensor_file(a: &[u8], n: usize) -> Vec<u8> {
        let view = TensorView::new(Dtype::F32, vec![n], a).unwrap();
        safetensors::tensor::serialize([("w", view)], None).unwrap()
    }

    /// A file made of a raw JSON header and `data_len` zero bytes.
    fn raw(header: &str, data_len: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.resize(v.len() + data_len, 0);
        v
    }

    fn err_of(bytes: &[u8]) -> String {
        let t = Tmp::new(bytes);
        match SafetensorsFile::open(&t.0) {
            Ok(_) => panic!("accepted a bad file"),
            Err(OpenError::Invalid(Error::InvalidArgument(m))) => {
                assert!(m.contains(&t.0.display().to_string()), "{m}");
                m
            }
            Err(e) => panic!("unexpected error kind: {e}"),
        }
    }

    #[test]
    fn round_trip() {
        let t = Tmp::new(&sample());
        let f = SafetensorsFile::open(&t.0).unwrap();
        let names: Vec<_> = f.tensors().iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names.len(), 4);
        assert_eq!(f.metadata().unwrap()["format"], "pt");
        let a = f.info("a").unwrap();
        assert_eq!(
            (a.dtype, a.shape.clone(), a.numel),
            (Dtype::F32, vec![2, 3], 6)
        );

        // plain copy
        let mut out = vec![0u8; 24];
        f.copy_tensor("a", &mut out, Dtype::F32).unwrap();
        assert_eq!(out, f32_bytes(&[1.0, -2.5, 3.25, 1e-3, 65504.0, -0.0]));
        // f32 -> bf16 -> matches half
        let mut o16 = vec![0u8; 12];
        f.copy_tensor("a", &mut o16, Dtype::BF16).unwrap();
        let want: Vec<u8> = [1.0f32, -2.5, 3.25, 1e-3, 65504.0, -0.0]
            .iter()
            .flat_map(|x| bf16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        assert_eq!(o16, want);
        // f32 -> f16
        f.copy_tensor("a", &mut o16, Dtype::F16).unwrap();
        let want: Vec<u8> = [1.0f32, -2.5, 3.25, 1e-3, 65504.0, -0.0]
            .iter()
            .flat_map(|x| f16::from_f32(*x).to_bits().to_le_bytes())
            .collect();
        assert_eq!(o16, want);
        // bf16 -> f32 is exact
        let mut o32 = vec![0u8; 12];
        f.copy_tensor("b", &mut o32, Dtype::F32).unwrap();
        assert_eq!(o32, f32_bytes(&[1.5, -7.0, bf16::from_f32(0.1).to_f32()]));
        // i64 plain copy; no conversion to floats
        let mut oi = vec![0u8; 80];
        f.copy_tensor("c", &mut oi, Dtype::I64).unwrap();
        assert_eq!(&oi[8..16], &1i64.to_le_bytes());
        let e = f.copy_tensor("c", &mut o32[..], Dtype::F32).unwrap_err();
        assert!(e.to_string().contains("cannot convert I64"), "{e}");
        // wrong destination size, unknown name
        assert!(f.copy_tensor("a", &mut out[..20], Dtype::F32).is_err());
        assert!(f
            .copy_tensor("nope", &mut out, Dtype::F32)
            .unwrap_err()
            .to_string()
            .contains("no tensor named \"nope\""));
        // empty tensor
        f.copy_tensor("empty", &mut [], Dtype::BF16).unwrap();
    }

    #[test]
    fn large_parallel_conversion() {
        let n = 3 * PIECE_BYTES / 4 + 17;
        let vals: Vec<f32> = (0..n).map(|i| (i as f32) * 0.37 - 1000.0).collect();
        let a = f32_bytes(&vals);
        let bytes = one_tensor_file(&a, n);
        let t = Tmp::new(&bytes);
        let f = SafetensorsFile::open(&t.0).unwrap();
        let mut o = vec![0u8; n * 2];
        f.copy_tensor("w", &mut o, Dtype::BF16).unwrap();
        for (i, c) in o.chunks_exact(2).enumerate() {
            assert_eq!(load16(c), bf16::from_f32(vals[i]).to_bits(), "element {i}");
        }
        let mut o2 = vec![0u8; n * 4];
        f.copy_tensor("w", &mut o2, Dtype::F32).unwrap();
        assert_eq!(o2, a);
    }

    /// The element loops (aligned buffers) and the byte-wise loops (misaligned ones) give the
    /// bits of `half`'s scalar conversions, on random bit patterns (NaNs, infinities,
    /// subnormals and rounding ties included).
    #[test]
    fn conversions_match_half_aligned_or_not() {
        use Float::*;
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let n = 4099;
        let mut words: Vec<u32> = (0..n).map(|_| rng.next() as u32).collect();
        let specials = [
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0x7f80_0001,
            0xffff_ffff,
            0x0000_0001,
            0x8000_0000,
            0x3f80_8000,
            0x3f81_8000,
            0x7f7f_ffff,
            0x4780_0000,
            0x3380_0000,
        ];
        words[..specials.len()].copy_from_slice(&specials);
        let f32_src: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
        let h16_src: Vec<u8> = words
            .iter()
            .flat_map(|w| (*w as u16).to_le_bytes())
            .collect();
        let want = |from: Float, to: Float, i: usize| -> u32 {
            let x = match from {
                F32 => f32::from_bits(words[i]),
                BF16 => bf16::from_bits(words[i] as u16).to_f32(),
                F16 => f16::from_bits(words[i] as u16).to_f32(),
            };
            match to {
                F32 => x.to_bits(),
                BF16 => bf16::from_f32(x).to_bits() as u32,
                F16 => f16::from_f32(x).to_bits() as u32,
            }
        };
        for (from, to) in [
            (F32, BF16),
            (BF16, F32),
            (F16, F32),
            (F32, F16),
            (BF16, F16),
            (F16, BF16),
        ] {
            let src = if from == F32 { &f32_src } else { &h16_src };
            // Sources aligned (a u32 buffer) and misaligned (shifted by one byte), likewise the
            // destination.
            let mut sbuf = vec![0u32; src.len() / 4 + 2];
            for shift in [0usize, 1] {
                let s = &mut as_bytes_mut(&mut sbuf)[shift..shift + src.len()];
                s.copy_from_slice(src);
                let mut dbuf = vec![0u32; n * to.size() / 4 + 2];
                let d = &mut as_bytes_mut(&mut dbuf)[shift..shift + n * to.size()];
                convert_chunk(s, from, d, to);
                for i in 0..n {
                    let got = match to {
                        F32 => u32::from_le_bytes(d[4 * i..4 * i + 4].try_into().unwrap()),
                        _ => load16(&d[2 * i..2 * i + 2]) as u32,
                    };
                    let w = want(from, to, i);
                    // A NaN may come out with a different payload (quieted or not).
                    let nan = |b: u32| match to {
                        F32 => f32::from_bits(b).is_nan(),
                        BF16 => bf16::from_bits(b as u16).is_nan(),
                        F16 => f16::from_bits(b as u16).is_nan(),
                    };
                    let both_nan = nan(got) && nan(w);
                    assert!(
                        got == w || both_nan,
                        "{from:?}->{to:?} shift {shift} element {i} (bits {:#x}): {got:#x} != {w:#x}",
                        words[i]
                    );
                }
            }
        }
    }

    /// The bf16 conversions the reader uses (the crate's shared rounding) give the bits of
    /// `half`'s, NaN payloads included, on every f32 edge case: zeros, infinities, quiet and
    /// signalling NaNs, subnormals, the largest finite values and the overflow threshold, and the
    /// values at, just below and just above every rounding tie of every bf16.
    #[test]
    fn bf16_rounding_is_bit_identical_to_half() {
        let mut words: Vec<u32> = vec![
            0x0000_0000,
            0x8000_0000,
            0x7f80_0000,
            0xff80_0000,
            0x7fc0_0000,
            0xffc0_0000,
            0x7f80_0001,
            0x7fbf_ffff,
            0xff80_0001,
            0x7fff_ffff,
            0xffff_ffff,
            0x0000_0001,
            0x8000_0001,
            0x007f_ffff,
            0x807f_ffff,
            0x0080_0000,
            0x7f7f_ffff,
            0xff7f_ffff,
            0x7f7f_7fff,
            0x7f7f_8000,
        ];
        for h in 0..=u16::MAX as u32 {
            for low in [0x0000, 0x0001, 0x7fff, 0x8000, 0x8001, 0xffff] {
                words.push(h << 16 | low);
            }
        }
        for &w in &words {
            let got = f32_to_bf16_bits(w);
            let want = bf16::from_f32(f32::from_bits(w)).to_bits();
            assert_eq!(got, want, "f32 bits {w:#010x}: {got:#06x} != {want:#06x}");
        }
        for h in 0..=u16::MAX {
            let got = bf16_bits_to_f32(h).to_bits();
            // The reader's widening keeps NaN payloads as they are (a shift), as it always has;
            // `half` quiets NaNs, so compare those by NaN-ness.
            let want = bf16::from_bits(h).to_f32();
            assert!(
                got == want.to_bits() || (want.is_nan() && f32::from_bits(got).is_nan()),
                "bf16 bits {h:#06x}"
            );
            assert_eq!(got, (h as u32) << 16, "bf16 bits {h:#06x}");
        }
    }

    fn job<'a>(name: &'a str, dst: &'a mut [u8], dtype: Dtype) -> CopyJob<'a> {
        CopyJob { name, dst, dtype }
    }

    /// Several tensors in one call land where each belongs; a bad job anywhere fails the call
    /// before any destination is written.
    #[test]
    fn copy_many_checks_every_job_first() {
        let t = Tmp::new(&sample());
        let f = SafetensorsFile::open(&t.0).unwrap();
        let (mut a, mut b, mut c) = (vec![0u8; 12], vec![0u8; 12], vec![0u8; 80]);
        f.copy_many(vec![
            job("a", &mut a, Dtype::BF16),
            job("b", &mut b, Dtype::F32),
            job("c", &mut c, Dtype::I64),
        ])
        .unwrap();
        let mut a1 = vec![0u8; 12];
        f.copy_tensor("a", &mut a1, Dtype::BF16).unwrap();
        assert_eq!(a, a1);
        assert_eq!(b, f32_bytes(&[1.5, -7.0, bf16::from_f32(0.1).to_f32()]));
        assert_eq!(&c[8..16], &1i64.to_le_bytes());

        let (mut a, mut b) = (vec![7u8; 12], vec![7u8; 11]);
        let e = f
            .copy_many(vec![
                job("a", &mut a, Dtype::BF16),
                job("b", &mut b, Dtype::F32),
            ])
            .unwrap_err()
            .to_string();
        assert!(e.contains("destination holds 11 bytes"), "{e}");
        assert!(
            a.iter().all(|&x| x == 7),
            "a job was written before all were checked"
        );
        let mut c = vec![0u8; 40];
        let e = f
            .copy_many(vec![
                job("a", &mut a, Dtype::BF16),
                job("c", &mut c, Dtype::F32),
            ])
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot convert I64"), "{e}");
        assert!(a.iter().all(|&x| x == 7));
    }

    #[test]
    fn file_cut_short_after_opening_is_an_error() {
        let n = PIECE_BYTES / 2;
        let a = f32_bytes(&vec![1.5f32; n]);
        let bytes = one_tensor_file(&a, n);
        let t = Tmp::new(&bytes);
        let f = SafetensorsFile::open(&t.0).unwrap();
        // Another process truncates the file after it was validated.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&t.0)
            .unwrap()
            .set_len((bytes.len() - a.len() / 2) as u64)
            .unwrap();
        for (dtype, size) in [(Dtype::F32, 4), (Dtype::BF16, 2)] {
            let mut o = vec![0u8; n * size];
            let e = f.copy_tensor("w", &mut o, dtype).unwrap_err().to_string();
            assert!(e.contains("reading the file failed"), "{e}");
        }
    }

    #[test]
    fn truncated_file() {
        let mut b = sample();
        b.truncate(b.len() - 5);
        let m = err_of(&b);
        assert!(m.contains("run past the data section"), "{m}");
        let m = err_of(&b[..5]);
        assert!(m.contains("truncated"), "{m}");
        let m = err_of(&[]);
        assert!(m.contains("truncated"), "{m}");
    }

    #[test]
    fn header_longer_than_file() {
        let mut b = sample();
        let twice = b.len() as u64 * 2;
        b[..8].copy_from_slice(&twice.to_le_bytes());
        let m = err_of(&b);
        assert!(m.contains("runs past the end of the file"), "{m}");
        b[..8].copy_from_slice(&u64::MAX.to_le_bytes());
        let m = err_of(&b);
        assert!(m.contains("exceeds"), "{m}");
    }

    #[test]
    fn offsets_out_of_range() {
        let m = err_of(&raw(
            r#"{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}}"#,
            8,
        ));
        assert!(m.contains("\"w\"") && m.contains("run past"), "{m}");
        let m = err_of(&raw(
            r#"{"w":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}"#,
            8,
        ));
        assert!(m.contains("end before they start"), "{m}");
        let m = err_of(&raw(
            r#"{"w":{"dtype":"F32","shape":[1],"data_offsets":[-4,0]}}"#,
            8,
        ));
        assert!(m.contains("bad data offset"), "{m}");
    }

    #[test]
    fn overlapping_offsets() {
        let m = err_of(&raw(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                "b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#,
            12,
        ));
        assert!(
            m.contains("overlap") && m.contains("\"a\"") && m.contains("\"b\""),
            "{m}"
        );
        // identical ranges (an aliasing attempt)
        let m = err_of(&raw(
            r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
                "b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
            8,
        ));
        assert!(m.contains("overlap"), "{m}");
    }

    #[test]
    fn gap_rejected_by_reference_reader() {
        let m = err_of(&raw(
            r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
            8,
        ));
        assert!(m.contains("safetensors reader"), "{m}");
    }

    #[test]
    fn shape_bytes_mismatch() {
        let m = err_of(&raw(
            r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#,
            8,
        ));
        assert!(m.contains("needs 12 bytes") && m.contains("\"w\""), "{m}");
    }

    #[test]
    fn huge_shapes() {
        let m = err_of(&raw(
            r#"{"w":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,8]}}"#,
            8,
        ));
        assert!(m.contains("more elements than fit"), "{m}");
        let m = err_of(&raw(
            r#"{"w":{"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,8]}}"#,
            8,
        ));
        assert!(m.contains("overflows"), "{m}");
        let m = err_of(&raw(
            r#"{"w":{"dtype":"F32","shape":[1e30],"data_offsets":[0,8]}}"#,
            8,
        ));
        assert!(m.contains("bad dimension"), "{m}");
        let dims = vec!["1"; 65].join(",");
        let m = err_of(&raw(
            &format!(r#"{{"w":{{"dtype":"F32","shape":[{dims}],"data_offsets":[0,4]}}}}"#),
            4,
        ));
        assert!(m.contains("dimensions"), "{m}");
    }

    #[test]
    fn garbage_headers() {
        let mut b = 4u64.to_le_bytes().to_vec();
        b.extend_from_slice(&[0xff, 0xfe, 0x80, 0x81]);
        assert!(err_of(&b).contains("UTF-8"));
        assert!(err_of(&raw("not json", 0)).contains("not a JSON object"));
        assert!(err_of(&raw("[1,2]", 0)).contains("not a JSON object"));
        let m = err_of(&raw(
            r#"{"w":{"dtype":"Q7","shape":[1],"data_offsets":[0,4]}}"#,
            4,
        ));
        assert!(m.contains("unknown dtype"), "{m}");
        let m = err_of(&raw(r#"{"w":{"shape":[1],"data_offsets":[0,4]}}"#, 4));
        assert!(m.contains("dtype"), "{m}");
        let m = err_of(&raw(r#"{"__metadata__":{"a":1}}"#, 0));
        assert!(m.contains("__metadata__"), "{m}");
        let m = err_of(&raw(r#"{"w":5}"#, 0));
        assert!(m.contains("not an object"), "{m}");
    }

    #[test]
    fn open_missing_file_is_io_error() {
        let e = SafetensorsFile::open("/nonexistent/ramtorch/x.safetensors")
            .err()
            .unwrap();
        assert!(matches!(e, OpenError::Io { .. }), "{e}");
        assert!(e
            .to_string()
            .contains("/nonexistent/ramtorch/x.safetensors"));
    }

    #[test]
    fn fifo_is_refused_without_blocking() {
        let dir = std::env::temp_dir().join(format!("ramtorch-fifo-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("x.safetensors");
        let c = std::ffi::CString::new(path.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = SafetensorsFile::open(&path).err().unwrap();
        assert!(e.to_string().contains("not a regular file (a FIFO)"), "{e}");
        let e = SafetensorsFile::open(&dir).err().unwrap();
        assert!(
            e.to_string().contains("not a regular file (a directory)"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn duplicate_keys_are_refused() {
        let e = |s: &[u8]| {
            parse(s, "f")
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        let one = r#""a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}"#;
        let twice = format!("{{{one},{one}}}");
        assert!(
            e(&raw(&twice, 8)).contains("more than once"),
            "{}",
            e(&raw(&twice, 8))
        );
        let meta = r#""__metadata__":{"k":"v"}"#;
        let twice = format!("{{{meta},{one},{meta}}}");
        assert!(e(&raw(&twice, 8)).contains("more than once"));
        // Keys nested deeper, strings with quotes, colons and escapes are not top-level keys.
        let tricky = r#"{"__metadata__":{"a\":b":"x:\"y\"","a\":b2":"{"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        assert!(
            parse(&raw(tricky, 8), "f").is_ok(),
            "{}",
            e(&raw(tricky, 8))
        );
        assert_eq!(
            top_level_keys(r#"{"a":1,"b":{"a":2,"c":[{"d":3}]},"e\"":":"}"#),
            3
        );
    }

    /// A deterministic xorshift generator (no dependency).
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: usize) -> usize {
            (self.next() % n as u64) as usize
        }
    }

    /// The parser never panics: random buffers and mutations of valid files.
    #[test]
    fn parser_survives_random_and_mutated_input() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        let seeds = [
            sample(),
            raw(
                r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"BF16","shape":[2,1],"data_offsets":[8,12]}}"#,
                12,
            ),
        ];
        let mut accepted = 0;
        for i in 0..4000 {
            let buf: Vec<u8> = if i % 4 == 0 {
                let n = rng.below(300);
                (0..n).map(|_| rng.next() as u8).collect()
            } else {
                let mut b = seeds[i % 2].clone();
                for _ in 0..1 + rng.below(4) {
                    match rng.below(5) {
                        0 => {
                            let k = rng.below(b.len());
                            b[k] = rng.next() as u8;
                        }
                        1 => {
                            let k = rng.below(b.len() + 1);
                            b.truncate(k);
                        }
                        2 if b.len() >= 8 => {
                            // tweak the header length
                            let n = u64::from_le_bytes(b[..8].try_into().unwrap());
                            let d = rng.below(17) as u64;
                            let n = if rng.next() & 1 == 0 {
                                n.wrapping_add(d)
                            } else {
                                n.wrapping_sub(d)
                            };
                            b[..8].copy_from_slice(&n.to_le_bytes());
                        }
                        3 => {
                            // replace a digit in the header with a big number
                            if let Some(k) = (8..b.len().min(200))
                                .find(|&k| b[k].is_ascii_digit() && rng.below(8) == 0)
                            {
                                let big =
                                    ["18446744073709551615", "4294967296", "99999999999", "0"]
                                        [rng.below(4)];
                                b.splice(k..k + 1, big.bytes());
                            }
                        }
                        _ => {
                            let k = rng.below(b.len() + 1);
                            b.insert(k, rng.next() as u8);
                        }
                    }
                    if b.is_empty() {
                        break;
                    }
                }
                b
            };
            let r = std::panic::catch_unwind(|| parse(&buf, "fuzz"));
            if i % 16 == 0 {
                // Opening the file (positioned reads of the header) decides as parsing it whole.
                let tmp = Tmp::new(&buf);
                let opened = SafetensorsFile::open(&tmp.0);
                match (&r, &opened) {
                    (Ok(Ok(h)), Ok(f)) => assert_eq!(h.tensors, f.tensors(), "input {i}"),
                    (Ok(Err(_)), Err(OpenError::Invalid(_))) => {}
                    _ => panic!("input {i}: parse and open disagree: {:?}", opened.err()),
                }
            }
            match r {
                Ok(Ok(h)) => {
                    accepted += 1;
                    for t in &h.tensors {
                        assert!(t.start <= t.end && t.end <= buf.len());
                    }
                }
                Ok(Err(Error::InvalidArgument(m))) => assert!(m.starts_with("fuzz: "), "{m}"),
                Ok(Err(e)) => panic!("unexpected error kind {e}"),
                Err(_) => panic!("parser panicked on input {i}: {buf:?}"),
            }
        }
        assert!(accepted > 0, "no mutation left a valid file");
    }

    #[test]
    fn parse_dtype_names() {
        assert_eq!(parse_dtype("BF16").unwrap(), Dtype::BF16);
        assert_eq!(parse_dtype("F8_E4M3").unwrap(), Dtype::F8_E4M3);
        assert!(parse_dtype("bf16").is_err());
    }
}
