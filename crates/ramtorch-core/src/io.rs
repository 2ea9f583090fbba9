//! Reading `.safetensors` checkpoints straight into host memory.
//!
//! A file is memory-mapped ([`SafetensorsFile::open`]) and its header is validated twice: by our
//! own checks ([`parse`]), which give messages naming the file and the tensor, and by the
//! `safetensors` crate's own reader. Nothing is allocated from a size read in the file before that
//! size has been checked against the file's length; a file that breaks any rule is an
//! [`Error::InvalidArgument`], never a panic.
//!
//! [`SafetensorsFile::copy_tensor`] then copies one tensor into a caller's buffer, converting among
//! F32, BF16 and F16 on the way (any dtype may be copied unchanged), in parallel for large tensors.
//!
//! The mapping is read-only and private; a file truncated by another process *while* it is mapped
//! can still fault (SIGBUS) on access, as with any memory-mapped reader.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use memmap2::Mmap;
use rayon::prelude::*;
use serde_json::Value;

pub use safetensors::Dtype;

use crate::error::{Error, Result};

/// Longest header accepted, as the `safetensors` crate: 100 MiB.
pub const MAX_HEADER_BYTES: usize = 100 * 1024 * 1024;
/// Most dimensions a tensor may have.
pub const MAX_NDIM: usize = 64;
/// Tensors larger than this are copied by several threads.
const PARALLEL_BYTES: usize = 4 << 20;
/// Elements per parallel chunk.
const CHUNK_ELEMS: usize = 1 << 20;
/// Elements per conversion chunk: the buffer a core reads into stays in its L2 cache.
const CONVERT_ELEMS: usize = 1 << 16;

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
/// crate's own reader must accept the file too (it also requires the ranges to tile the data
/// section exactly).
pub fn parse(bytes: &[u8], what: &str) -> Result<Header> {
    let file_len = bytes.len();
    let Some(len_bytes) = bytes.get(..8) else {
        return Err(bad(
            what,
            format_args!("truncated: {file_len} bytes, shorter than the 8-byte header length"),
        ));
    };
    let n = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES as u64 {
        return Err(bad(
            what,
            format_args!("header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit"),
        ));
    }
    let n = n as usize; // ≤ 100 MiB
    let data_start = 8 + n;
    if data_start > file_len {
        return Err(bad(
            what,
            format_args!(
                "header length {n} runs past the end of the file ({file_len} bytes): truncated or corrupt"
            ),
        ));
    }
    let text = std::str::from_utf8(&bytes[8..data_start])
        .map_err(|e| bad(what, format_args!("header is not valid UTF-8 ({e})")))?;
    let root: serde_json::Map<String, Value> = serde_json::from_str(text)
        .map_err(|e| bad(what, format_args!("header is not a JSON object ({e})")))?;
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

    // Second opinion: the reference reader (contiguous tiling, its own overflow checks).
    safetensors::SafeTensors::read_metadata(bytes).map_err(|e| {
        bad(
            what,
            format_args!("rejected by the safetensors reader: {e}"),
        )
    })?;

    Ok(Header {
        tensors,
        metadata,
        data_start,
    })
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

/// A memory-mapped, validated `.safetensors` file.
pub struct SafetensorsFile {
    path: PathBuf,
    file: File,
    map: Mmap,
    header: Header,
    index: HashMap<String, usize>,
}

/// Why a file could not be opened: the OS refused, or the file is not valid safetensors.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// Opening, inspecting or mapping the file failed.
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

impl SafetensorsFile {
    /// Maps and validates the file at `path` (see [`parse`]).
    pub fn open(path: impl AsRef<Path>) -> std::result::Result<Self, OpenError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| OpenError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let meta = file.metadata().map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::other("not a regular file")));
        }
        let what = path.display().to_string();
        if meta.len() < 8 {
            return Err(bad(
                &what,
                format_args!(
                    "truncated: {} bytes, shorter than the 8-byte header length",
                    meta.len()
                ),
            )
            .into());
        }
        // SAFETY: the mapping is read-only and private; we never hand out references that outlive
        // `self`. Concurrent truncation of the file by another process can fault, as documented.
        let map = unsafe { Mmap::map(&file) }.map_err(io)?;
        let header = parse(&map, &what)?;
        let _ = map.advise(memmap2::Advice::Sequential);
        let index = header
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(Self {
            path,
            file,
            map,
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

    /// The raw bytes of tensor `name` (in the file's dtype, little-endian).
    pub fn bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.info(name)?;
        Ok(&self.map[t.start..t.end])
    }

    /// Copies tensor `name` into `dst`, converting to `dst_dtype`: any dtype to itself (a plain
    /// copy), or among F32, BF16 and F16. `dst` must hold exactly the converted tensor.
    pub fn copy_tensor(&self, name: &str, dst: &mut [u8], dst_dtype: Dtype) -> Result<()> {
        let t = self.info(name)?;
        let src = &self.map[t.start..t.end];
        let what = || format!("{}: tensor {name:?}", self.path.display());
        if t.dtype == dst_dtype {
            if dst.len() != src.len() {
                return Err(Error::InvalidArgument(format!(
                    "{}: destination holds {} bytes, the tensor has {}",
                    what(),
                    dst.len(),
                    src.len()
                )));
            }
            if src.len() < PARALLEL_BYTES {
                dst.copy_from_slice(src);
                self.drop_pages(t.start, t.end);
                return Ok(());
            }
            // Large tensors are read from the page cache straight into `dst` by all cores
            // (positioned reads: no page-table work for the file's pages, which mapped reads pay
            // one page fault at a time).
            let ch = CHUNK_ELEMS * 4;
            return dst
                .par_chunks_mut(ch)
                .enumerate()
                .try_for_each(|(i, d)| self.read_at(d, t.start + i * ch, &what));
        }
        let (Some(from), Some(to)) = (Float::of(t.dtype), Float::of(dst_dtype)) else {
            return Err(Error::InvalidArgument(format!(
                "{}: cannot convert {} to {dst_dtype} (conversions are among F32, BF16 and F16)",
                what(),
                t.dtype
            )));
        };
        let need = t.numel.checked_mul(to.size()).ok_or_else(|| {
            Error::InvalidArgument(format!("{}: destination size overflows", what()))
        })?;
        if dst.len() != need {
            return Err(Error::InvalidArgument(format!(
                "{}: destination holds {} bytes, {} of {dst_dtype} needs {need}",
                what(),
                dst.len(),
                t.numel
            )));
        }
        let (ss, ds) = (from.size(), to.size());
        if src.len().max(dst.len()) < PARALLEL_BYTES {
            convert_chunk(src, from, dst, to);
            self.drop_pages(t.start, t.end);
            return Ok(());
        }
        // Each core reads a chunk from the page cache into a buffer of its own and converts it.
        dst.par_chunks_mut(CONVERT_ELEMS * ds)
            .enumerate()
            .try_for_each_init(Vec::new, |buf: &mut Vec<u8>, (i, d)| {
                buf.resize(d.len() / ds * ss, 0);
                self.read_at(buf, t.start + i * CONVERT_ELEMS * ss, &what)?;
                convert_chunk(buf, from, d, to);
                Ok(())
            })
    }

    /// Reads `buf.len()` bytes of the file at `offset` (a file cut short since it was validated
    /// is an error, where a mapped read would crash the process).
    fn read_at(&self, buf: &mut [u8], offset: usize, what: &dyn Fn() -> String) -> Result<()> {
        use std::os::unix::fs::FileExt;
        self.file.read_exact_at(buf, offset as u64).map_err(|e| {
            Error::InvalidArgument(format!("{}: reading the file failed: {e}", what()))
        })
    }

    /// Unmaps the pages of `start..end` from this process once they are copied, so a load of
    /// many tensors holds at most one tensor's worth of mapped file pages (the resident set stays
    /// at one copy of the model); the page cache keeps them, and a later read maps them again.
    fn drop_pages(&self, start: usize, end: usize) {
        // SAFETY: the mapping is read-only and backed by the file: a page dropped here is mapped
        // again from the page cache on the next access, with the same contents, so no reference
        // into the map (this thread's or another's, on a shared boundary page) sees a change.
        // Failure only leaves the pages mapped.
        let _ = unsafe {
            self.map
                .unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, end - start)
        };
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

fn convert_chunk(src: &[u8], from: Float, dst: &mut [u8], to: Float) {
    use Float::*;
    match (from, to) {
        (BF16, F32) => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                d.copy_from_slice(&((load16(s) as u32) << 16).to_le_bytes());
            }
        }
        (F16, F32) => {
            for (d, s) in dst.chunks_exact_mut(4).zip(src.chunks_exact(2)) {
                d.copy_from_slice(&f16::from_bits(load16(s)).to_f32().to_bits().to_le_bytes());
            }
        }
        (F32, BF16) => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let x = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        (F32, F16) => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(4)) {
                let x = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
                d.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        (BF16, F16) => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let x = bf16::from_bits(load16(s)).to_f32();
                d.copy_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
            }
        }
        (F16, BF16) => {
            for (d, s) in dst.chunks_exact_mut(2).zip(src.chunks_exact(2)) {
                let x = f16::from_bits(load16(s)).to_f32();
                d.copy_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
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
        let n = 3 * CHUNK_ELEMS + 17;
        let vals: Vec<f32> = (0..n).map(|i| (i as f32) * 0.37 - 1000.0).collect();
        let a = f32_bytes(&vals);
        let bytes = one_tensor_file(&a, n);
        let t = Tmp::new(&bytes);
        let f = SafetensorsFile::open(&t.0).unwrap();
        let mut o = vec![0u8; n * 2];
        f.copy_tensor("w", &mut o, Dtype::BF16).unwrap();
        for (i, c) in o.chunks_exact(2).enumerate().step_by(9973) {
            assert_eq!(load16(c), bf16::from_f32(vals[i]).to_bits());
        }
        let mut o2 = vec![0u8; n * 4];
        f.copy_tensor("w", &mut o2, Dtype::F32).unwrap();
        assert_eq!(o2, a);
    }

    #[test]
    fn file_cut_short_after_opening_is_an_error() {
        let n = 2 * CHUNK_ELEMS;
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
