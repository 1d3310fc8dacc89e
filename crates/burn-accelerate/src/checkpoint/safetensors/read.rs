//! Loading weights back from safetensors files: memory-mapped, each tensor copied once into its parameter,
//! strictly or partially, with key remapping and layout conversion.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::{Bool, DType, Int, Tensor};
use safetensors::tensor::{Dtype, SafeTensors};

use super::layout::{KeyRemap, LAYOUT_KEY, WeightLayout};
use super::{corrupt, from_safetensors_dtype, weight_files};
use crate::checkpoint::fs::{io, read};
use crate::error::{Error, Result};

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
    fn tensor(&self, key: &str) -> Option<Result<StoredTensor<'_>>> {
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
                    file: path,
                    dtype,
                    shape: entry.shape.clone(),
                    bytes: &bytes[entry.bytes.clone()],
                }),
        )
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
    let source = Source::open(path, &options.remap)?;
    let layout = options.layout.or(source.layout).unwrap_or_default();
    struct Apply<'a> {
        source: &'a Source,
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
            tensor: Tensor<D, K>,
        ) -> Tensor<D, K> {
            let name = self.stack.join(".");
            if self.error.is_some() {
                return tensor;
            }
            let (key, stored_shape) =
                self.layout
                    .file_key(&name, tensor.dtype(), &tensor.dims(), &self.containers);
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
                        tensor.dims(),
                        stored_shape,
                        self.layout.tag()
                    ),
                ));
                return tensor;
            }
            let data = match self.layout.restored(
                &name,
                (stored.dtype, &stored.shape),
                stored.bytes,
                &self.containers,
            ) {
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
            Tensor::from_data(data, (&device, dtype))
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
            param.map(|t| {
                if !t.is_autodiff() {
                    return self.load(t);
                }
                // Load the plain values, then make them the (tracked) parameter of the autodiff graph again.
                let loaded = Tensor::from_inner(self.load(t.inner()));
                if requires_grad {
                    loaded.require_grad()
                } else {
                    loaded
                }
            })
        }
        fn map_int<const D: usize>(
            &mut self,
            param: Param<Tensor<D, Int>>,
        ) -> Param<Tensor<D, Int>> {
            param.map(|t| self.load(t))
        }
        fn map_bool<const D: usize>(
            &mut self,
            param: Param<Tensor<D, Bool>>,
        ) -> Param<Tensor<D, Bool>> {
            param.map(|t| self.load(t))
        }
    }
    let mut apply = Apply {
        source: &source,
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
