//! Loading weights back from safetensors files: memory-mapped, each tensor copied once into its parameter,
//! strictly or partially, with key remapping and layout conversion.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param, ParamId};
use burn::tensor::{Bool, DType, Int, Tensor};
use safetensors::tensor::{Dtype, SafeTensors};

use super::layout::{KeyRemap, LAYOUT_KEY, WeightLayout};
use super::{corrupt, from_safetensors_dtype, weight_files};
use crate::distributed::strategy::Slicing;
use crate::error::{Error, Result};
use crate::fs::{io, read};

/// What a load renamed and did not match.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Parameters of the model that the checkpoint does not have (they keep their values).
    pub missing: Vec<String>,
    /// Tensors of the checkpoint that the model does not have (their keys after remapping).
    pub unexpected: Vec<String>,
    /// Checkpoint keys that the key remapping renamed, as (stored key, key used).
    pub remapped: Vec<(String, String)>,
}

/// How [`load_weights`] treats the checkpoint.
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    /// Fail unless the checkpoint and the model have exactly the same tensors (default `false`: load what
    /// matches and report the rest).
    pub strict: bool,
    /// Cast every loaded tensor to this dtype (default: each parameter keeps its current dtype).
    pub dtype: Option<DType>,
    /// The layout of the checkpoint (default `None`: the layout the file records, else PyTorch's, which is what
    /// PyTorch and Hugging Face tools write).
    pub layout: Option<WeightLayout>,
    /// Renames the checkpoint's keys before they are matched to the model's parameters (e.g. strip `model.`).
    pub remap: KeyRemap,
}

/// A checkpoint file's bytes, memory-mapped: each tensor is copied once, from the page cache straight into its
/// tensor's data, without first reading the whole file into memory (a 1 GB checkpoint needs no extra 1 GB).
///
/// A mapped file must not shrink while it is read (the process would get `SIGBUS`); this crate's writers
/// never change a file in place (they write a temporary file and rename it), so only an outside program
/// truncating the file could. Files that cannot be mapped (empty, or a filesystem without mmap) are read.
enum FileBytes {
    Mapped(memmap2::Mmap),
    Read(Vec<u8>),
}

impl std::ops::Deref for FileBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        match self {
            FileBytes::Mapped(map) => map,
            FileBytes::Read(bytes) => bytes,
        }
    }
}

impl FileBytes {
    /// Lets the kernel drop this process's mapping of `range` (a tensor copied out already): the pages stay in
    /// the page cache, but stop counting in the process's resident memory, so that a load holds one tensor's
    /// pages at a time rather than, by the end, the whole file. A later read maps them again.
    fn release(&self, range: std::ops::Range<usize>) {
        #[cfg(unix)]
        if let FileBytes::Mapped(map) = self
            && !range.is_empty()
        {
            // SAFETY: the map is read-only and shared: dropping its pages cannot change what it reads (the
            // file's contents come back on the next access), and no borrow of these bytes outlives the copy.
            let _ = unsafe {
                map.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    range.start,
                    range.len(),
                )
            };
        }
        #[cfg(not(unix))]
        let _ = range;
    }

    fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(io("reading", path))?;
        let len = file.metadata().map_err(io("reading", path))?.len();
        if len == 0 {
            return Ok(FileBytes::Read(Vec::new()));
        }
        // SAFETY: see the type's documentation; the map is read-only.
        match unsafe { memmap2::Mmap::map(&file) } {
            Ok(map) => Ok(FileBytes::Mapped(map)),
            Err(_) => read(path).map(FileBytes::Read),
        }
    }
}

/// One tensor of a checkpoint file, its bytes borrowed from the mapped file.
struct StoredTensor<'a> {
    key: &'a str,
    file: &'a Path,
    dtype: DType,
    shape: Vec<usize>,
    bytes: &'a [u8],
}

/// Where one tensor lies: its file, its key there, and what the file's header says of it (read once, when the
/// file is opened, not again for every tensor).
struct Entry {
    file: usize,
    stored_key: String,
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: std::ops::Range<usize>,
}

/// The tensors of a checkpoint: key (after remapping) -> where it lies.
struct Source {
    files: Vec<(PathBuf, FileBytes)>,
    names: BTreeMap<String, Entry>,
    /// The layout the files record, if any.
    layout: Option<WeightLayout>,
    remapped: Vec<(String, String)>,
}

impl Source {
    fn open(path: &Path, remap: &KeyRemap) -> Result<Self> {
        Self::from_files(weight_files(path)?, remap)
    }

    fn from_files(paths: Vec<PathBuf>, remap: &KeyRemap) -> Result<Self> {
        let mut files = Vec::with_capacity(paths.len());
        let mut names = BTreeMap::new();
        let mut layout = None;
        let mut remapped = Vec::new();
        for path in paths {
            let bytes = FileBytes::open(&path)?;
            let (_, metadata) = SafeTensors::read_metadata(&bytes).map_err(|e| {
                corrupt(
                    &path,
                    format!("not a valid safetensors file (truncated or corrupt?): {e}"),
                )
            })?;
            let tag = metadata
                .metadata()
                .as_ref()
                .and_then(|m| m.get(LAYOUT_KEY).cloned());
            if let Some(tag) = tag {
                let recorded = WeightLayout::from_tag(&tag).ok_or_else(|| {
                    corrupt(
                        &path,
                        format!("records the unknown layout `{tag}` under {LAYOUT_KEY}"),
                    )
                })?;
                layout = Some(recorded);
            }
            let tensors = SafeTensors::deserialize(&bytes).map_err(|e| {
                corrupt(
                    &path,
                    format!("not a valid safetensors file (truncated or corrupt?): {e}"),
                )
            })?;
            for (name, view) in tensors.tensors() {
                let name = name.as_str();
                let start = view.data().as_ptr() as usize - bytes.as_ptr() as usize;
                let entry = Entry {
                    file: files.len(),
                    stored_key: name.to_string(),
                    dtype: view.dtype(),
                    shape: view.shape().to_vec(),
                    bytes: start..start + view.data().len(),
                };
                let key = match remap.apply(name) {
                    Some(new) => {
                        remapped.push((name.to_string(), new.clone()));
                        new
                    }
                    None => name.to_string(),
                };
                if let Some(Entry {
                    stored_key: other, ..
                }) = names.insert(key.clone(), entry)
                {
                    return Err(corrupt(
                        &path,
                        format!(
                            "the key remapping gives `{other}` and `{name}` the same key `{key}`"
                        ),
                    ));
                }
            }
            files.push((path, bytes));
        }
        remapped.sort();
        Ok(Self {
            files,
            names,
            layout,
            remapped,
        })
    }

    /// The tensor stored under `key` (after remapping): its file, dtype, shape and bytes (borrowed from the
    /// mapped file, not copied).
    fn tensor<'a>(&'a self, key: &'a str) -> Option<Result<StoredTensor<'a>>> {
        let entry = self.names.get(key)?;
        let (path, bytes) = &self.files[entry.file];
        Some(
            from_safetensors_dtype(entry.dtype)
                .ok_or_else(|| {
                    corrupt(
                        path,
                        format!(
                            "tensor `{}` has unsupported dtype {:?}",
                            entry.stored_key, entry.dtype
                        ),
                    )
                })
                .map(|dtype| StoredTensor {
                    key,
                    file: path,
                    dtype,
                    shape: entry.shape.clone(),
                    bytes: &bytes[entry.bytes.clone()],
                }),
        )
    }

    /// Releases the mapped pages of the tensor under `key` once it has been copied out, with the kernel's
    /// fault-around window on either side: a read near a tensor's edge maps the cached pages around it too (up to
    /// 64 KiB), which would otherwise stay mapped when they belong to a neighbour released already (7 MB over the
    /// load of a 232 M-parameter checkpoint).
    fn release(&self, key: &str) {
        const FAULT_AROUND: usize = 64 << 10;
        if let Some(entry) = self.names.get(key) {
            let file = &self.files[entry.file].1;
            let start = entry.bytes.start.saturating_sub(FAULT_AROUND);
            let end = (entry.bytes.end + FAULT_AROUND).min(file.len());
            file.release(start..end);
        }
    }

    /// Releases the mapped pages of `part` (a byte range within the tensor under `key`) once read.
    fn release_part(&self, key: &str, part: std::ops::Range<usize>) {
        if let Some(entry) = self.names.get(key) {
            let start = entry.bytes.start + part.start;
            let end = (entry.bytes.start + part.end).min(entry.bytes.end);
            self.files[entry.file].1.release(start..end);
        }
    }
}

/// Loads the weights at `path` (a `.safetensors` file, a folder written by `write_safetensors` or by
/// Hugging Face tools, or an index file) into `module`, matching tensors by their dotted path. A tensor whose
/// shape differs from the parameter's is an error naming both; with `strict`, missing or unexpected tensors
/// are errors too, otherwise they are reported.
pub fn load_weights<M: Module>(
    module: M,
    path: &Path,
    options: &LoadOptions,
) -> Result<(M, LoadReport)> {
    load_weights_split(module, path, options, &|_| None)
}

/// How a parameter is split over the ranks of its shard group, and this rank's place there: what
/// [`load_weights_split`] asks of each parameter.
pub(crate) type SlicingOf<'a> = &'a dyn Fn(ParamId) -> Option<(Slicing, usize)>;

/// [`load_weights`] into a model whose parameters may be held as dim-0 slices (`FULL_SHARD`): a parameter that
/// `split_of` says this rank holds a slice of (its shape the slice's, not the whole's) gets only its rows of the
/// stored tensor, read from the mapped file (in PyTorch's `[out, in]` layout, a band of columns transposed),
/// so that no rank builds a whole tensor; every other parameter is loaded whole. Each tensor's mapped pages
/// are released once copied, so a rank's memory grows by its slices, not by the file.
pub(crate) fn load_weights_split<M: Module>(
    module: M,
    path: &Path,
    options: &LoadOptions,
    split_of: SlicingOf<'_>,
) -> Result<(M, LoadReport)> {
    load_weights_parts(module, path, options, split_of, &|_| None)
}

/// What a tensor-parallel rank holds of a parameter: `(dim, rank, parts)`, its slice `rank` of `parts` equal
/// ones along `dim`; `None` where it holds the parameter whole.
pub(crate) type TensorSliceOf<'a> = &'a dyn Fn(ParamId) -> Option<(usize, usize, usize)>;

/// [`load_weights_split`], a tensor-parallel rank keeping its slice of each split parameter (`tp_of`): a slice of
/// rows is read alone, as a sharded slice is; a slice of columns from its whole tensor, cut and let go.
pub(crate) fn load_weights_parts<M: Module>(
    module: M,
    path: &Path,
    options: &LoadOptions,
    split_of: SlicingOf<'_>,
    tp_of: TensorSliceOf<'_>,
) -> Result<(M, LoadReport)> {
    let source = Source::open(path, &options.remap)?;
    let layout = options.layout.or(source.layout).unwrap_or_default();
    struct Apply<'a> {
        source: &'a Source,
        split_of: SlicingOf<'a>,
        tp_of: TensorSliceOf<'a>,
        options: &'a LoadOptions,
        layout: WeightLayout,
        stack: Vec<String>,
        containers: Vec<String>,
        seen: Vec<String>,
        missing: Vec<String>,
        error: Option<Error>,
    }
    impl Apply<'_> {
        fn load<const D: usize, K: burn::tensor::kind::Basic>(
            &mut self,
            id: ParamId,
            tensor: Tensor<D, K>,
        ) -> Tensor<D, K> {
            let name = self.stack.join(".");
            if self.error.is_some() {
                return tensor;
            }
            // A slice of a parameter split over the ranks (of its tensor-parallel part, under both): its shape is
            // the slice's, the split's the part's.
            let slice = (self.split_of)(id).filter(|(split, me)| {
                let local = split.local_dims(*me);
                tensor.dims().as_slice() == local.as_slice() && split.dims() != local.as_slice()
            });
            // A tensor-parallel part: the whole tensor's shape, `parts` times the part's dimension `dim`.
            let tp = (self.tp_of)(id);
            let part_dims = slice.as_ref().map_or_else(
                || tensor.dims().to_vec(),
                |(split, _)| split.dims().to_vec(),
            );
            let whole_dims = match tp {
                Some((dim, _, parts)) => {
                    let mut dims = part_dims.clone();
                    dims[dim] *= parts;
                    dims
                }
                None => part_dims.clone(),
            };
            let (key, stored_shape) =
                self.layout
                    .file_key(&name, tensor.dtype(), &whole_dims, &self.containers);
            let Some(found) = self.source.tensor(&key) else {
                self.missing.push(key);
                return tensor;
            };
            self.seen.push(key.clone());
            let stored = match found {
                Ok(v) => v,
                Err(e) => {
                    self.error = Some(e);
                    return tensor;
                }
            };
            let file = stored.file.to_path_buf();
            if stored.shape.as_slice() != stored_shape.as_slice() {
                self.error = Some(corrupt(
                    &file,
                    format!(
                        "tensor `{key}` has shape {:?}, but the model's parameter `{name}` has shape {:?} ({:?} in \
                         the checkpoint's {} layout); load with the layout the file was written in",
                        stored.shape,
                        whole_dims,
                        stored_shape,
                        self.layout.tag()
                    ),
                ));
                return tensor;
            }
            // The rows of the whole to read: a slice's (of its tensor-parallel part of rows: a row split, vocabulary
            // rows, a column split's bias), or a part of rows; a part of columns is read whole and cut below.
            let rows_of_part = |rank: usize| rank * part_dims[0];
            let rows = match (&slice, tp) {
                (Some((split, me)), None) => Some((split.held_rows(*me), split.local_dims(*me)[0])),
                (Some((split, me)), Some((0, rank, _))) => {
                    let held = split.held_rows(*me);
                    let start = rows_of_part(rank);
                    Some((
                        start + held.start..start + held.end,
                        split.local_dims(*me)[0],
                    ))
                }
                (None, Some((0, rank, _))) => {
                    Some((rows_of_part(rank)..rows_of_part(rank + 1), part_dims[0]))
                }
                _ => None,
            };
            let restored = match rows.clone() {
                Some((rows, local_rows)) => {
                    if self.options.dtype.is_some_and(|d| d != tensor.dtype()) {
                        self.error = Some(Error::InvalidArgument(format!(
                            "load_checkpoint_in_model: `{name}` is held as a slice of a sharded model, whose \
                             dtype is fixed at prepare_model; cast the model before preparing it, or load \
                             without `dtype`"
                        )));
                        return tensor;
                    }
                    self.layout.restored_rows(
                        &name,
                        (stored.dtype, &stored.shape),
                        stored.bytes,
                        &self.containers,
                        (rows, local_rows),
                        &|part| self.source.release_part(stored.key, part),
                    )
                }
                None => self.layout.restored(
                    &name,
                    (stored.dtype, &stored.shape),
                    stored.bytes,
                    &self.containers,
                ),
            };
            self.source.release(stored.key);
            let data = match restored {
                Ok(d) => d,
                Err(e) => {
                    self.error = Some(corrupt(&file, format!("tensor `{key}`: {e}")));
                    return tensor;
                }
            };
            let dtype = self.options.dtype.unwrap_or(tensor.dtype());
            let data = match data.try_cast(dtype) {
                Ok(d) => d,
                Err(e) => {
                    self.error = Some(corrupt(
                        &file,
                        format!("tensor `{name}` cannot be cast to {dtype:?}: {e}"),
                    ));
                    return tensor;
                }
            };
            let device = tensor.device();
            // The old value goes before the new one is made: a rank's memory holds one of them at a time.
            let local = tensor.dims();
            drop(tensor);
            let restored = Tensor::from_data(data, (&device, dtype));
            let (dim, rank) = match tp {
                Some((dim, rank, _)) if dim > 0 => (dim, rank),
                _ => return restored,
            };
            let len = part_dims[dim];
            let part = restored.narrow(dim, rank * len, len);
            match slice {
                // This rank's rows of its part of columns, padded as the sharded strategy holds them.
                Some((split, me)) => {
                    let held = split.held_rows(me);
                    if held.is_empty() {
                        return Tensor::zeros(local, (&device, dtype));
                    }
                    let part = part.narrow(0, held.start, held.len());
                    let pad = local[0] - held.len();
                    match pad {
                        0 => part,
                        _ => {
                            let mut dims = local;
                            dims[0] = pad;
                            Tensor::cat(vec![part, Tensor::zeros(dims, (&device, dtype))], 0)
                        }
                    }
                }
                None => part,
            }
        }
    }
    impl ModuleMapper for Apply<'_> {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.stack.push(name.to_string());
            self.containers.push(container_type.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
            self.containers.pop();
        }
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let requires_grad = param.is_require_grad();
            let id = param.id;
            let loaded = param.map(|t| {
                if !t.is_autodiff() {
                    return self.load(id, t);
                }
                // Load the plain values, then make them the (tracked) parameter of the autodiff graph again.
                let loaded = Tensor::from_inner(self.load(id, t.inner()));
                if requires_grad {
                    loaded.require_grad()
                } else {
                    loaded
                }
            });
            // The old value and the read buffers are freed: back to the system before the next tensor.
            crate::heap::release_after_freeing(loaded.lazy_shape().num_elements() * 4);
            loaded
        }
        fn map_int<const D: usize>(
            &mut self,
            param: Param<Tensor<D, Int>>,
        ) -> Param<Tensor<D, Int>> {
            let id = param.id;
            param.map(|t| self.load(id, t))
        }
        fn map_bool<const D: usize>(
            &mut self,
            param: Param<Tensor<D, Bool>>,
        ) -> Param<Tensor<D, Bool>> {
            let id = param.id;
            param.map(|t| self.load(id, t))
        }
    }
    let mut apply = Apply {
        source: &source,
        split_of,
        tp_of,
        options,
        layout,
        stack: Vec::new(),
        containers: Vec::new(),
        seen: Vec::new(),
        missing: Vec::new(),
        error: None,
    };
    let module = module.map(&mut apply);
    if let Some(e) = apply.error {
        return Err(e);
    }
    let unexpected: Vec<String> = source
        .names
        .keys()
        .filter(|n| !apply.seen.contains(n))
        .cloned()
        .collect();
    let report = LoadReport {
        missing: apply.missing,
        unexpected,
        remapped: source.remapped.clone(),
    };
    if options.strict && (!report.missing.is_empty() || !report.unexpected.is_empty()) {
        return Err(corrupt(
            path,
            format!(
                "strict load: missing from the checkpoint {:?}; not in the model {:?}",
                report.missing, report.unexpected
            ),
        ));
    }
    Ok((module, report))
}
