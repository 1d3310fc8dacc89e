//! Tensor layouts and key remapping for weights shared with PyTorch and Hugging Face tools.
//!
//! Burn keeps a `Linear` weight as `[in, out]` and names normalisation parameters `gamma`/`beta`; PyTorch keeps
//! `[out, in]` and says `weight`/`bias`. [`WeightLayout::PyTorch`] converts with burn-store's
//! `BurnToPyTorchAdapter` on save and `PyTorchToBurnAdapter` on load (a Linear weight is transposed, a
//! `BatchNorm`/`LayerNorm`/`GroupNorm`/`RmsNorm` parameter renamed); convolutions, embeddings and everything
//! else have the same layout in both. [`KeyRemap`] renames keys with ordered regex rules (burn-store's
//! `KeyRemapper`), e.g. to strip the `model.` or `module.` prefix a training wrapper added.

use burn::store::bridge;
use burn::store::{
    BurnToPyTorchAdapter, KeyRemapper, ModuleAdapter, ModuleContext, PyTorchToBurnAdapter,
};
use burn::tensor::{DType, Shape, TensorData};

use crate::error::{Error, Result};

/// The safetensors metadata key that records the layout a file was written in.
pub const LAYOUT_KEY: &str = "burn_accelerate_layout";

/// How tensors are laid out in a safetensors checkpoint.
///
/// The default is PyTorch's: a `model.safetensors` in Hugging Face's file layout is expected to load into the
/// matching `torch.nn` module, and a Burn ↔ Burn round trip stays exact either way (the load converts back).
/// A file records the layout it was written in, and loading follows that record; files without one (written
/// by PyTorch or Hugging Face tools) are read as PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightLayout {
    /// PyTorch's: Linear weights `[out, in]`, normalisation parameters `weight`/`bias`.
    #[default]
    PyTorch,
    /// Burn's own: Linear weights `[in, out]`, normalisation parameters `gamma`/`beta`.
    Burn,
}

impl WeightLayout {
    /// The name recorded in a file's metadata.
    pub fn tag(self) -> &'static str {
        match self {
            WeightLayout::PyTorch => "pytorch",
            WeightLayout::Burn => "burn",
        }
    }

    /// The layout a metadata tag names.
    pub fn from_tag(tag: &str) -> Option<Self> {
        match tag {
            "pytorch" => Some(WeightLayout::PyTorch),
            "burn" => Some(WeightLayout::Burn),
            _ => None,
        }
    }

    /// The tensor as this layout stores it: its key and data, for a parameter at `name` (dotted path) inside
    /// the modules `containers` (outermost first, e.g. `["Struct:Net", "Struct:Linear"]`).
    pub(crate) fn stored(
        self,
        name: String,
        data: TensorData,
        containers: &[String],
    ) -> Result<(String, TensorData)> {
        match self {
            WeightLayout::Burn => Ok((name, data)),
            WeightLayout::PyTorch => {
                let (key, _) = self.file_key(&name, data.dtype(), data.shape(), containers);
                if self.transposes(&name, data.dtype(), data.shape(), containers) {
                    return Ok((key, transpose_2d(&data)));
                }
                let adapted = BurnToPyTorchAdapter.adapt(
                    bridge::from_data(data, name, None),
                    ModuleContext::new(containers),
                );
                let data = bridge::into_data(adapted).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "save_model: converting `{key}` to PyTorch's layout: {e}"
                    ))
                })?;
                Ok((key, data))
            }
        }
    }

    /// Whether this layout stores the parameter at `name` (of `dtype` and `shape`, inside `containers`)
    /// transposed; otherwise its data is stored as Burn holds it (at most its key changes).
    pub(crate) fn transposes(
        self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        containers: &[String],
    ) -> bool {
        self == WeightLayout::PyTorch
            && adapter_transposes(&BurnToPyTorchAdapter, name, (dtype, shape), containers)
    }

    /// The key and shape under which this layout stores a parameter of `shape` at `name` (no data is read).
    pub(crate) fn file_key(
        self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        containers: &[String],
    ) -> (String, Vec<usize>) {
        match self {
            WeightLayout::Burn => (name.to_string(), shape.to_vec()),
            WeightLayout::PyTorch => {
                let probe = bridge::deferred(
                    name.to_string(),
                    dtype,
                    Shape::from(shape.to_vec()),
                    None,
                    || unreachable!("only the key and shape of the probe are read"),
                );
                let adapted = BurnToPyTorchAdapter.adapt(probe, ModuleContext::new(containers));
                (adapted.name.clone(), adapted.shape.to_vec())
            }
        }
    }

    /// Stored bytes (`dtype`, `shape`, e.g. borrowed from a mapped file) of the parameter at `name` (Burn's
    /// path) back in Burn's layout, copied once: transposed straight from `bytes` when the layout transposes
    /// this parameter.
    pub(crate) fn restored(
        self,
        name: &str,
        (dtype, shape): (DType, &[usize]),
        bytes: &[u8],
        containers: &[String],
    ) -> std::result::Result<TensorData, String> {
        if bytes.len() != shape.iter().product::<usize>() * dtype.size() {
            return Err(format!(
                "{} bytes for shape {shape:?} of {dtype:?}",
                bytes.len()
            ));
        }
        if self == WeightLayout::PyTorch
            && adapter_transposes(&PyTorchToBurnAdapter, name, (dtype, shape), containers)
        {
            return Ok(transpose_bytes(bytes, (shape[0], shape[1]), dtype));
        }
        let data =
            crate::host_data::filled(shape.to_vec(), dtype, |dst| dst.copy_from_slice(bytes));
        match self {
            WeightLayout::Burn => Ok(data),
            // Not transposed: the adapter only renames (the data passes through).
            WeightLayout::PyTorch => {
                let adapted = PyTorchToBurnAdapter.adapt(
                    bridge::from_data(data, name.to_string(), None),
                    ModuleContext::new(containers),
                );
                bridge::into_data(adapted).map_err(|e| e.to_string())
            }
        }
    }
}

impl WeightLayout {
    /// Rows `rows` of the parameter at `name` (Burn's path; its first dimension in Burn's layout), restored
    /// from the stored bytes of the whole tensor (`dtype`, `shape`, e.g. borrowed from a mapped file) into a
    /// buffer of `local_rows` rows, zero-padded past the held ones: one rank's dim-0 slice, read without building
    /// the whole tensor. In PyTorch's `[out, in]` layout a Burn slice is a band of columns, transposed straight
    /// from `bytes` a stripe of stored rows at a time, each stripe handed to `done` (its byte range in `bytes`)
    /// once read, so that a mapped file's pages can be let go while the band is still being read.
    pub(crate) fn restored_rows(
        self,
        name: &str,
        (dtype, shape): (DType, &[usize]),
        bytes: &[u8],
        containers: &[String],
        (rows, local_rows): (std::ops::Range<usize>, usize),
        done: &dyn Fn(std::ops::Range<usize>),
    ) -> std::result::Result<TensorData, String> {
        if bytes.len() != shape.iter().product::<usize>() * dtype.size() {
            return Err(format!(
                "{} bytes for shape {shape:?} of {dtype:?}",
                bytes.len()
            ));
        }
        if matches!(dtype, DType::QFloat(_)) {
            return Err("a quantized tensor cannot be read in slices".into());
        }
        let transposed = self == WeightLayout::PyTorch
            && adapter_transposes(&PyTorchToBurnAdapter, name, (dtype, shape), containers);
        let burn_shape: Vec<usize> = if transposed {
            vec![shape[1], shape[0]]
        } else {
            shape.to_vec()
        };
        let total_rows = burn_shape.first().copied().unwrap_or(1);
        if rows.end > total_rows || rows.len() > local_rows {
            return Err(format!(
                "rows {rows:?} into {local_rows} of a tensor of {total_rows} rows"
            ));
        }
        let mut local_shape = burn_shape.clone();
        if let Some(first) = local_shape.first_mut() {
            *first = local_rows;
        }
        let row_bytes = burn_shape.iter().skip(1).product::<usize>() * dtype.size();
        if transposed {
            // Stored `[out, in]`: Burn's row `c` is stored column `c`. A stripe of stored rows gives a tile of
            // every held Burn row, copied into its place.
            let (out, cols) = (shape[0], shape[1]);
            let size = dtype.size();
            let stripe = (STRIPE_BYTES / (cols * size).max(1)).max(1);
            return Ok(crate::host_data::filled(local_shape, dtype, |dst| {
                for first in (0..out).step_by(stripe) {
                    let last = (first + stripe).min(out);
                    let range = first * cols * size..last * cols * size;
                    let tile = transposed_columns(
                        &bytes[range.clone()],
                        (last - first, cols),
                        dtype,
                        rows.clone(),
                        Parallel::No,
                    );
                    let run = (last - first) * size;
                    for (i, line) in tile.as_bytes().chunks_exact(run.max(1)).enumerate() {
                        let at = (i * out + first) * size;
                        dst[at..at + run].copy_from_slice(line);
                    }
                    done(range);
                }
            }));
        }
        let held = &bytes[rows.start * row_bytes..rows.end * row_bytes];
        Ok(crate::host_data::filled(local_shape, dtype, |dst| {
            dst[..held.len()].copy_from_slice(held)
        }))
    }
}

/// The stored bytes a band of a transposed tensor is read from at a time (see
/// [`WeightLayout::restored_rows`]).
const STRIPE_BYTES: usize = 1 << 20;

/// Whether `adapter` transposes the 2-D tensor `data` at `name`: it is asked about a 2 × 3 stand-in of the
/// same name, dtype and place (its choice depends on those, not on the size), whose answer shows whether the
/// elements moved. The real transposition is then done by [`transpose_2d`], which is much faster than the
/// adapter's element-by-element copy on large matrices.
fn adapter_transposes(
    adapter: &impl ModuleAdapter,
    name: &str,
    (dtype, shape): (DType, &[usize]),
    containers: &[String],
) -> bool {
    if shape.len() != 2 || !matches!(dtype.size(), 1 | 2 | 4 | 8) {
        return false;
    }
    let size = dtype.size();
    // Elements 0..6, each one `size` bytes wide with its index in the first byte.
    let mut bytes = vec![0u8; 6 * size];
    for i in 0..6 {
        bytes[i * size] = i as u8;
    }
    let probe = TensorData::from_bytes_vec(bytes, vec![2, 3], dtype);
    let adapted = adapter.adapt(
        bridge::from_data(probe, name.to_string(), None),
        ModuleContext::new(containers),
    );
    match bridge::into_data(adapted) {
        Ok(out) => {
            let firsts: Vec<u8> = out.as_bytes().chunks(size).map(|c| c[0]).collect();
            out.shape().to_vec() == [3, 2] && firsts == [0, 3, 1, 4, 2, 5]
        }
        Err(_) => false,
    }
}

/// The transpose of a 2-D tensor of 1-, 2-, 4- or 8-byte elements, copied in cache-sized tiles.
pub(crate) fn transpose_2d(data: &TensorData) -> TensorData {
    let shape = data.shape();
    transpose_bytes(data.as_bytes(), (shape[0], shape[1]), data.dtype())
}

/// [`transpose_2d`] of the row-major `rows × cols` elements of `dtype` in `src` (e.g. straight from a mapped
/// file, without an intermediate copy).
pub(crate) fn transpose_bytes(
    src: &[u8],
    (rows, cols): (usize, usize),
    dtype: DType,
) -> TensorData {
    transposed_columns(src, (rows, cols), dtype, 0..cols, Parallel::Yes)
}

/// Whether a large transpose may use every core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Parallel {
    /// Split between as many threads as there are cores.
    Yes,
    /// On the calling thread only (e.g. when another thread already works beside it).
    #[cfg_attr(not(feature = "flex"), allow(dead_code))]
    No,
}

/// The columns `columns` of the row-major `rows × cols` elements of `dtype` in `src`, as the rows of a
/// `columns.len() × rows` tensor: one band of the transpose (a save writes a large transposed weight band by
/// band).
pub(crate) fn transposed_columns(
    src: &[u8],
    (rows, cols): (usize, usize),
    dtype: DType,
    columns: std::ops::Range<usize>,
    parallel: Parallel,
) -> TensorData {
    assert!(src.len() == rows * cols * dtype.size() && columns.end <= cols);
    let first = columns.start;
    crate::host_data::filled(vec![columns.len(), rows], dtype, |dst| {
        let typed = match dtype.size() {
            1 => transpose_as::<u8>(src, dst, (rows, cols), first, parallel),
            2 => transpose_as::<u16>(src, dst, (rows, cols), first, parallel),
            4 => transpose_as::<u32>(src, dst, (rows, cols), first, parallel),
            8 => transpose_as::<u64>(src, dst, (rows, cols), first, parallel),
            other => unreachable!("checked by adapter_transposes: element size {other}"),
        };
        if !typed {
            transpose_unaligned(src, dst, (rows, cols), first, dtype.size());
        }
    })
}

/// Transposes columns `first..` of `src` into `dst` as elements of `T` (a plain integer type of the elements'
/// width), if both are aligned for `T`; returns whether it did.
fn transpose_as<T: Copy + Default + Send + Sync>(
    src: &[u8],
    dst: &mut [u8],
    (rows, cols): (usize, usize),
    first: usize,
    parallel: Parallel,
) -> bool {
    // SAFETY: `T` is an integer type, valid for every bit pattern; `align_to` only reinterprets the aligned
    // middle of each slice, and the transposition is used only when there is nothing outside it.
    let (src_head, src_elems, src_tail) = unsafe { src.align_to::<T>() };
    let (dst_head, dst_elems, dst_tail) = unsafe { dst.align_to_mut::<T>() };
    if !(src_head.is_empty() && src_tail.is_empty() && dst_head.is_empty() && dst_tail.is_empty()) {
        return false;
    }
    transpose_elements(src_elems, dst_elems, (rows, cols), first, parallel);
    true
}

/// Matrices of at least this many bytes are transposed by several threads, each writing its own band of the
/// output (below it, starting threads costs more than it saves).
const PARALLEL_TRANSPOSE_BYTES: usize = 1 << 20;

/// The 8 × 8 blocks [`transpose_columns`] moves at once.
const BLOCK: usize = 8;

/// Columns `first..` of the row-major `rows × cols` matrix `src`, transposed into `dst` (as many as it has
/// room for). Large outputs are split, when `parallel` allows, into bands of output rows, one per core,
/// transposed side by side; each thread also takes the page faults of its band of a fresh output.
fn transpose_elements<T: Copy + Default + Send + Sync>(
    src: &[T],
    dst: &mut [T],
    (rows, cols): (usize, usize),
    first: usize,
    parallel: Parallel,
) {
    assert!(src.len() == rows * cols && dst.len().is_multiple_of(rows.max(1)));
    if dst.is_empty() {
        return;
    }
    let count = dst.len() / rows;
    assert!(first + count <= cols);
    let threads =
        if parallel == Parallel::Yes && std::mem::size_of_val(dst) >= PARALLEL_TRANSPOSE_BYTES {
            std::thread::available_parallelism().map_or(1, |n| n.get().min(16))
        } else {
            1
        };
    let band = count.div_ceil(threads).next_multiple_of(BLOCK);
    if band >= count {
        return transpose_columns(src, dst, (rows, cols), first);
    }
    std::thread::scope(|scope| {
        let mut bands = dst.chunks_mut(band * rows).enumerate().peekable();
        while let Some((i, part)) = bands.next() {
            let start = first + i * band;
            if bands.peek().is_some() {
                scope.spawn(move || transpose_columns(src, part, (rows, cols), start));
            } else {
                transpose_columns(src, part, (rows, cols), start);
            }
        }
    });
}

/// Columns `first..` of the row-major `rows × cols` matrix `src`, transposed into `dst` (as many as it has room
/// for) on this thread: in cache-sized tiles, each made of 8 × 8 blocks read as 8 contiguous rows and written as
/// 8 contiguous rows (the compiler turns both into vector loads and stores), then the edges element by element.
fn transpose_columns<T: Copy + Default>(
    src: &[T],
    dst: &mut [T],
    (rows, cols): (usize, usize),
    first: usize,
) {
    const TILE: usize = 64;
    let last = first + dst.len() / rows;
    let full_rows = rows - rows % BLOCK;
    let full_end = first + (last - first) / BLOCK * BLOCK;
    for r0 in (0..full_rows).step_by(TILE) {
        for c0 in (first..full_end).step_by(TILE) {
            for r in (r0..(r0 + TILE).min(full_rows)).step_by(BLOCK) {
                for c in (c0..(c0 + TILE).min(full_end)).step_by(BLOCK) {
                    let mut block = [[T::default(); BLOCK]; BLOCK];
                    for (i, line) in block.iter_mut().enumerate() {
                        let start = (r + i) * cols + c;
                        line.copy_from_slice(&src[start..start + BLOCK]);
                    }
                    for (j, column) in (c..c + BLOCK).enumerate() {
                        let start = (column - first) * rows + r;
                        let out = &mut dst[start..start + BLOCK];
                        for (i, v) in out.iter_mut().enumerate() {
                            *v = block[i][j];
                        }
                    }
                }
            }
        }
    }
    // The last rows % BLOCK rows and the columns past the last whole block.
    for r in 0..rows {
        let from = if r < full_rows { full_end } else { first };
        for c in from..last {
            dst[(c - first) * rows + r] = src[r * cols + c];
        }
    }
}

/// [`transpose_elements`] byte by byte, for buffers not aligned to the element size.
fn transpose_unaligned(
    src: &[u8],
    dst: &mut [u8],
    (rows, cols): (usize, usize),
    first: usize,
    size: usize,
) {
    let last = first + dst.len() / (rows * size).max(1);
    for r in 0..rows {
        for c in first..last {
            let from = (r * cols + c) * size;
            let to = ((c - first) * rows + r) * size;
            dst[to..to + size].copy_from_slice(&src[from..from + size]);
        }
    }
}

/// Ordered key-renaming rules: each regex replaces every match in the key, in turn (burn-store's
/// `KeyRemapper` semantics).
///
/// ```
/// use burn_accelerate::checkpoint::KeyRemap;
/// let remap = KeyRemap::new().strip_prefix("model.")?.rule(r"^layers\.(\d+)\.", "blocks.$1.")?;
/// assert_eq!(remap.apply("model.layers.3.weight").as_deref(), Some("blocks.3.weight"));
/// assert_eq!(remap.apply("head.bias"), None); // unchanged
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct KeyRemap(KeyRemapper);

impl KeyRemap {
    /// No rules.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a rule: `pattern` (a regex) is replaced by `replacement` (`$1` names a capture group).
    ///
    /// # Errors
    /// An invalid regex (the error shows it).
    pub fn rule(self, pattern: &str, replacement: &str) -> Result<Self> {
        self.0
            .add_pattern(pattern, replacement)
            .map(Self)
            .map_err(|e| {
                Error::InvalidArgument(format!("key remapping: invalid pattern `{pattern}`: {e}"))
            })
    }

    /// Adds a rule that removes `prefix` from the start of keys.
    ///
    /// # Errors
    /// Never for a plain prefix (it is escaped); kept as `Result` like [`rule`](Self::rule).
    pub fn strip_prefix(self, prefix: &str) -> Result<Self> {
        let pattern = format!("^{}", escape(prefix));
        self.rule(&pattern, "")
    }

    /// Whether there are no rules.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The renamed key, or `None` when no rule changes it.
    pub fn apply(&self, key: &str) -> Option<String> {
        let mut out = key.to_string();
        for (pattern, replacement) in &self.0.patterns {
            if pattern.is_match(&out) {
                out = pattern.replace_all(&out, replacement.as_str()).to_string();
            }
        }
        (out != key).then_some(out)
    }
}

/// `text` with regex metacharacters escaped.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fast_transpose_matches_the_adapters_for_every_element_size() {
        let containers = vec!["Struct:Net".to_string(), "Struct:Linear".to_string()];
        for dtype in [
            DType::U8,
            DType::F16,
            DType::BF16,
            DType::F32,
            DType::F64,
            DType::I64,
        ] {
            let (rows, cols) = (37, 70);
            let size = dtype.size();
            let bytes: Vec<u8> = (0..rows * cols * size)
                .map(|i| (i * 31 % 251) as u8)
                .collect();
            let data = TensorData::from_bytes_vec(bytes, vec![rows, cols], dtype);
            assert!(adapter_transposes(
                &BurnToPyTorchAdapter,
                "layer.weight",
                (dtype, &[rows, cols]),
                &containers
            ));
            let slow = bridge::into_data(BurnToPyTorchAdapter.adapt(
                bridge::from_data(data.clone(), "layer.weight".into(), None),
                ModuleContext::new(&containers),
            ))
            .unwrap();
            let fast = transpose_2d(&data);
            assert_eq!(fast.shape().to_vec(), vec![cols, rows]);
            assert_eq!(fast.as_bytes(), slow.as_bytes(), "{dtype:?}");
            // And back.
            assert_eq!(transpose_2d(&fast).as_bytes(), data.as_bytes());
            // From bytes that are not aligned to the element size (a file whose tensors are not), the same.
            let mut shifted = vec![0u8; data.as_bytes().len() + 1];
            shifted[1..].copy_from_slice(data.as_bytes());
            if size > 1 {
                let shifted = &shifted[1..];
                assert_ne!(shifted.as_ptr() as usize % size, 0);
                let unaligned = transpose_bytes(shifted, (rows, cols), dtype);
                assert_eq!(
                    unaligned.as_bytes(),
                    slow.as_bytes(),
                    "{dtype:?}, unaligned"
                );
            }
        }
        // Matrices large enough to be split between threads, of shapes that leave ragged edges and bands.
        for (rows, cols) in [
            (523, 611),
            (1, 300_000),
            (300_000, 1),
            (1030, 257),
            (8, 40_000),
        ] {
            let src: Vec<u32> = (0..rows * cols).map(|i| i as u32).collect();
            let mut dst = vec![0u32; rows * cols];
            transpose_elements(&src, &mut dst, (rows, cols), 0, Parallel::Yes);
            for r in 0..rows {
                for c in 0..cols {
                    assert_eq!(
                        dst[c * rows + r],
                        src[r * cols + c],
                        "{rows}x{cols} at ({r}, {c})"
                    );
                }
            }
            // And bands of columns starting anywhere, aligned or not.
            let bytes: Vec<u8> = src.iter().flat_map(|v| v.to_le_bytes()).collect();
            for columns in [
                0..cols,
                cols / 3..cols,
                1..(cols / 2).max(1),
                cols - 1..cols,
            ] {
                let band = transposed_columns(
                    &bytes,
                    (rows, cols),
                    DType::U32,
                    columns.clone(),
                    Parallel::Yes,
                );
                assert_eq!(band.shape().to_vec(), vec![columns.len(), rows]);
                let whole = &dst[columns.start * rows..columns.end * rows];
                assert_eq!(
                    band.as_slice::<u32>().unwrap(),
                    whole,
                    "{rows}x{cols}, columns {columns:?}"
                );
                let mut shifted = vec![0u8; bytes.len() + 1];
                shifted[1..].copy_from_slice(&bytes);
                let unaligned = transposed_columns(
                    &shifted[1..],
                    (rows, cols),
                    DType::U32,
                    columns.clone(),
                    Parallel::No,
                );
                assert_eq!(
                    unaligned.as_bytes(),
                    band.as_bytes(),
                    "{rows}x{cols}, columns {columns:?}, unaligned"
                );
            }
        }
        transpose_elements::<u32>(&[], &mut [], (0, 5), 0, Parallel::Yes);
        // A bias (1-D) and a non-Linear 2-D parameter are not transposed.
        let embedding = vec!["Struct:Net".to_string(), "Struct:Embedding".to_string()];
        let data = TensorData::from_bytes_vec(vec![0u8; 24], vec![2, 3], DType::F32);
        assert!(!adapter_transposes(
            &BurnToPyTorchAdapter,
            "emb.weight",
            (data.dtype(), &[2, 3]),
            &embedding
        ));
    }
}
