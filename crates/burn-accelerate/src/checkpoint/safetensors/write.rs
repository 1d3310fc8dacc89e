//! Writing weights as safetensors: named parameters, shards of at most a given size, bands streamed from the
//! device on a writer thread, and an atomic replacement of the previous save.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{Bool, DType, Int, Tensor, TensorData};

use super::layout::{KeyRemap, LAYOUT_KEY, WeightLayout};
use super::stream::{BandReader, Content, TensorToWrite, band_reader};
use super::{INDEX_FILE, SINGLE_FILE};
use crate::distributed::strategy::LazyParams;
use crate::error::{Error, Result};
use crate::fs::{io, sync_dir};

/// One named parameter of a module.
struct Named {
    name: String,
    tensor: Held,
    /// The module types around it, outermost first (`Struct:Net`, `Struct:Linear`).
    containers: Vec<String>,
}

/// A parameter's values: copied to the host, or left on its device to be read in bands when written.
enum Held {
    Host(TensorData),
    Device {
        dtype: DType,
        shape: Vec<usize>,
        read: BandReader,
        /// Fetched from another rank at its first band (see [`LazyParams`]).
        fetched: bool,
    },
}

/// The one fetched parameter held at a time (dropped when the next is fetched).
type Fetched = std::rc::Rc<std::cell::RefCell<Option<(ParamId, Tensor<1>)>>>;

/// A reader of bands of parameter `id` (of whole shape `dims`), fetched through `lazy` at the first band.
fn lazy_band_reader<const D: usize>(
    lazy: std::rc::Rc<dyn LazyParams>,
    held: Fetched,
    id: ParamId,
    dims: Vec<usize>,
) -> BandReader {
    Box::new(move |transposed, range| {
        let mut slot = held.borrow_mut();
        if slot.as_ref().is_none_or(|(current, _)| *current != id) {
            // Drop the previous parameter before fetching this one: one at a time.
            *slot = None;
            let flat = lazy.fetch(id).map_err(|e| e.to_string())?;
            *slot = Some((id, flat));
        }
        let flat = slot
            .as_ref()
            .map(|(_, t)| t.clone())
            .expect("fetched above");
        let dims: [usize; D] = dims
            .clone()
            .try_into()
            .map_err(|_| format!("parameter {id}: {} dimensions, not {D}", dims.len()))?;
        let tensor: Tensor<D> = flat.reshape(dims);
        let tensor = if tensor.is_autodiff() {
            tensor.inner()
        } else {
            tensor
        };
        band_reader(tensor)(transposed, range)
    })
}

/// Every parameter of `module` with its dotted path (`encoder.layers.0.weight`), in visiting order. Float
/// parameters stay on their device (a save reads them band by band); others are copied to the host now. Those
/// `lazy` names are fetched through it when written.
fn named_tensors<M: Module>(
    module: &M,
    lazy: Option<std::rc::Rc<dyn LazyParams>>,
) -> Result<Vec<Named>> {
    struct Collect {
        out: Vec<Named>,
        stack: Vec<String>,
        containers: Vec<String>,
        error: Option<Error>,
        lazy: Option<std::rc::Rc<dyn LazyParams>>,
        held: Fetched,
    }
    impl Collect {
        fn push<const D: usize, K: burn::tensor::kind::Basic>(&mut self, tensor: &Tensor<D, K>) {
            if self.error.is_some() {
                return;
            }
            match tensor.clone().try_into_data() {
                Ok(data) => self.push_held(Held::Host(data)),
                Err(e) => {
                    self.error = Some(Error::Execution {
                        operation: "save_model",
                        device: format!("{:?}", tensor.device()),
                        reason: e.to_string(),
                    })
                }
            }
        }
        fn push_held(&mut self, tensor: Held) {
            self.out.push(Named {
                name: self.stack.join("."),
                tensor,
                containers: self.containers.clone(),
            });
        }
    }
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.stack.push(name.to_string());
            self.containers.push(container_type.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.stack.pop();
            self.containers.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.error.is_some() {
                return;
            }
            if let Some(lazy) = &self.lazy
                && let Some(dims) = lazy.whole_dims(param.id)
            {
                let dtype = param.val().dtype();
                let read =
                    lazy_band_reader::<D>(lazy.clone(), self.held.clone(), param.id, dims.clone());
                self.push_held(Held::Device {
                    dtype,
                    shape: dims,
                    read,
                    fetched: true,
                });
                return;
            }
            let tensor = param.val();
            // The plain values: reading bands must not add operations to an autodiff graph.
            let tensor = if tensor.is_autodiff() {
                tensor.inner()
            } else {
                tensor
            };
            match tensor.dtype() {
                dtype @ (DType::F64 | DType::F32 | DType::F16 | DType::BF16) => {
                    self.push_held(Held::Device {
                        dtype,
                        shape: tensor.dims().to_vec(),
                        read: band_reader(tensor),
                        fetched: false,
                    })
                }
                // Quantized and other packed floats are copied whole (and refused by the writer if unsupported).
                _ => self.push(&tensor),
            }
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            self.push(&param.val());
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
            self.push(&param.val());
        }
    }
    let mut collect = Collect {
        out: Vec::new(),
        stack: Vec::new(),
        containers: Vec::new(),
        error: None,
        lazy,
        held: Fetched::default(),
    };
    module.visit(&mut collect);
    match collect.error {
        Some(e) => Err(e),
        None => Ok(collect.out),
    }
}

/// `module`'s Burn record (burnpack: each tensor under its module path, with its parameter id, as
/// `Module::into_record` writes it), each tensor's bytes read from the module only when a writer reaches it
/// ([`write_record`]): a save holds one tensor's copy at a time, not a copy of the model.
pub(crate) fn record_tensors<M: Module>(module: &M) -> Vec<burn_pack::Tensor> {
    struct Collect {
        path: Vec<String>,
        out: Vec<burn_pack::Tensor>,
    }
    impl Collect {
        fn push<const D: usize, K: burn::tensor::kind::Basic + 'static>(
            &mut self,
            id: ParamId,
            tensor: Tensor<D, K>,
        ) {
            let name = self.path.join(".");
            let (dtype, shape) = (tensor.dtype(), tensor.dims().to_vec());
            let entry = if matches!(dtype, DType::QFloat(_)) {
                // Quantized data packs its values with their scales: its length is known once read.
                let data = tensor.into_data();
                let shape = data.shape().to_vec();
                burn_pack::Tensor::new(name, dtype, shape, Some(id.val()), data.into_bytes())
            } else {
                let len = shape.iter().product::<usize>() * dtype.size();
                burn_pack::Tensor::deferred(name, dtype, shape, Some(id.val()), len, move || {
                    Ok(tensor.clone().into_data().into_bytes())
                })
            };
            self.out.push(entry);
        }
    }
    impl ModuleVisitor for Collect {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        // The `on_save` form, as Burn's own record takes it (what its load un-maps).
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.push(param.id, param.transform_for_save().val());
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<D, Int>>) {
            self.push(param.id, param.transform_for_save().val());
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<D, Bool>>) {
            self.push(param.id, param.transform_for_save().val());
        }
    }
    let mut collect = Collect {
        path: Vec::new(),
        out: Vec::new(),
    };
    module.visit(&mut collect);
    collect.out
}

/// Writes a Burn record made by [`record_tensors`] to `path` (burnpack), one tensor's bytes at a time, into a
/// temporary file synced and renamed into place.
pub(crate) fn write_record(tensors: Vec<burn_pack::Tensor>, path: &Path) -> Result<()> {
    burn_pack::Writer::new(tensors)
        .auto_extension(false)
        .write_to_file(path)
        .map_err(|e| io("writing", path)(std::io::Error::other(e.to_string())))
}

/// Writes `module`'s Burn record to `dir/model.bpk` atomically, one tensor at a time; returns the file.
pub fn write_burnpack<M: Module>(module: &M, dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let path = dir.join("model.bpk");
    write_record(record_tensors(module), &path)?;
    sync_dir(dir)?;
    Ok(path)
}

/// Writes `module`'s weights into `dir` in Hugging Face's safetensors layout, in `layout` with keys renamed by
/// `remap`, sharded greedily so that no shard exceeds `max_shard_size` (unless one tensor alone does). Files of
/// an earlier save that the new one does not use are removed. Returns the files written.
pub fn write_safetensors<M: Module>(
    module: &M,
    dir: &Path,
    max_shard_size: u64,
    layout: WeightLayout,
    remap: &KeyRemap,
) -> Result<Vec<PathBuf>> {
    let tensors = plan(module, layout, remap, None)?;
    write_planned(tensors, dir, max_shard_size, layout, &mut || {})
}

/// The tensors a save of `module` writes, in order, with their keys in `layout` renamed by `remap`; nothing is
/// read yet. Fails as the save would (two tensors under one key, no parameters), the same on every rank.
pub(crate) fn plan<M: Module>(
    module: &M,
    layout: WeightLayout,
    remap: &KeyRemap,
    lazy: Option<std::rc::Rc<dyn LazyParams>>,
) -> Result<Vec<TensorToWrite>> {
    let mut tensors: Vec<TensorToWrite> = Vec::new();
    let mut keys = std::collections::HashSet::new();
    for t in named_tensors(module, lazy)? {
        let stored = match t.tensor {
            Held::Host(data) => {
                let (key, data) = layout.stored(t.name.clone(), data, &t.containers)?;
                TensorToWrite {
                    key,
                    dtype: data.dtype(),
                    shape: data.shape().to_vec(),
                    content: Content::Host(data),
                    fetched: false,
                }
            }
            Held::Device {
                dtype,
                shape,
                read,
                fetched,
            } => {
                let transposed = layout.transposes(&t.name, dtype, &shape, &t.containers);
                let (key, shape) = layout.file_key(&t.name, dtype, &shape, &t.containers);
                TensorToWrite {
                    key,
                    dtype,
                    shape,
                    content: Content::Bands { read, transposed },
                    fetched,
                }
            }
        };
        let key = remap.apply(&stored.key).unwrap_or(stored.key);
        if !keys.insert(key.clone()) {
            return Err(Error::InvalidArgument(format!(
                "save_model: two tensors would be saved as `{key}` (the last is `{}`); change the key remapping",
                t.name
            )));
        }
        tensors.push(TensorToWrite { key, ..stored });
    }
    if tensors.is_empty() {
        return Err(Error::InvalidArgument(
            "save_model: the model has no parameters to save".into(),
        ));
    }
    Ok(tensors)
}

/// `tensors` in files of at most `max_shard_size` bytes, in order (greedily; a tensor larger than that alone).
fn shards_of(tensors: &[TensorToWrite], max_shard_size: u64) -> Vec<Vec<&TensorToWrite>> {
    let mut shards: Vec<Vec<&TensorToWrite>> = vec![Vec::new()];
    let mut current = 0u64;
    for t in tensors {
        let size = t.byte_len() as u64;
        if current + size > max_shard_size && !shards.last().expect("one shard").is_empty() {
            shards.push(Vec::new());
            current = 0;
        }
        shards.last_mut().expect("one shard").push(t);
        current += size;
    }
    shards
}

/// On a rank that does not write: takes part in every fetch the writer of the same planned `tensors` makes, in
/// the order it makes them (file by file, each file's tensors in the order the file holds them), dropping each
/// fetched parameter at once.
pub(crate) fn drain_planned(tensors: &[TensorToWrite], max_shard_size: u64) -> Result<()> {
    for shard in shards_of(tensors, max_shard_size) {
        for (t, _) in super::stream::file_order(&shard)? {
            if let (true, Content::Bands { read, .. }) = (t.fetched, &t.content) {
                read(false, 0..1).map_err(|reason| Error::Execution {
                    operation: "save_model",
                    device: format!("fetching `{}`", t.key),
                    reason,
                })?;
            }
        }
    }
    Ok(())
}

/// Writes the planned `tensors` into `dir` (see [`write_safetensors`]), calling `after_step` after every change
/// to what the folder's loader would see (the tests load the folder there, to show that no instant mixes two
/// saves).
pub(crate) fn write_planned(
    tensors: Vec<TensorToWrite>,
    dir: &Path,
    max_shard_size: u64,
    layout: WeightLayout,
    after_step: &mut dyn FnMut(),
) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir).map_err(io("creating", dir))?;
    let shards = shards_of(&tensors, max_shard_size);
    let n = shards.len();
    let name_of = |i: usize| {
        if n == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", i + 1, n)
        }
    };
    let mut staged: Vec<(PathBuf, PathBuf)> = Vec::new();
    let mut weight_map = BTreeMap::new();
    let mut total_size = 0u64;
    let mut stage = || -> Result<()> {
        for (i, shard) in shards.iter().enumerate() {
            let file = name_of(i);
            for t in shard {
                weight_map.insert(t.key.clone(), file.clone());
                total_size += t.byte_len() as u64;
            }
            let mut metadata = HashMap::new();
            metadata.insert("format".to_string(), "pt".to_string());
            metadata.insert(LAYOUT_KEY.to_string(), layout.tag().to_string());
            let path = dir.join(&file);
            // An exclusively created temporary (never a pre-existing file or link), streamed to band by band
            // (no copy of the weights in memory), then synced.
            let (tmp, handle) = crate::fs::create_temporary(&path)?;
            staged.push((tmp.clone(), path));
            super::stream::write_file(handle, &tmp, shard, metadata)?;
        }
        Ok(())
    };
    if let Err(e) = stage() {
        for (tmp, _) in &staged {
            let _ = std::fs::remove_file(tmp);
        }
        return Err(e);
    }
    let index = (n > 1).then(|| {
        let index = serde_json::json!({
            "metadata": { "total_size": total_size },
            "weight_map": weight_map,
        });
        serde_json::to_vec_pretty(&index).expect("JSON of strings and numbers")
    });
    commit_weights(dir, staged, index, after_step)
}

/// Suffix of the second name a shard of the previous save gets when the new save reuses its name.
const REPLACED: &str = ".replaced";

/// Whether `name` is one of the files `save_model` writes into a folder (including its temporaries).
fn is_weight_file(name: &str) -> bool {
    let base = name.split(".partial.").next().unwrap_or(name);
    let base = base.strip_suffix(REPLACED).unwrap_or(base);
    base == SINGLE_FILE
        || base == INDEX_FILE
        || (base.starts_with("model-") && base.ends_with(".safetensors") && base.contains("-of-"))
}

/// Puts the staged files (temporary, final) of a new save in place so that the folder loads, at every instant,
/// either the complete previous weights or the complete new ones; a crash never mixes them. The index, when
/// there is one, is what the loader reads first, so it is the commit point:
/// 1. shards of the live index that the new save will overwrite get a second name (a hard link) and the live
///    index is rewritten to it: the previous weights stay loadable;
/// 2. the new files are renamed into place (the live index names none of them);
/// 3. commit: the new index replaces the live one, or, for a single-file save, the live index is removed;
/// 4. files of the previous save that the new one does not use are removed.
///
/// The caller holds the folder's lock, so leftovers of an interrupted save are known to be stale.
fn commit_weights(
    dir: &Path,
    staged: Vec<(PathBuf, PathBuf)>,
    index: Option<Vec<u8>>,
    after_step: &mut dyn FnMut(),
) -> Result<Vec<PathBuf>> {
    let index_path = dir.join(INDEX_FILE);
    let new_names: std::collections::HashSet<String> = staged
        .iter()
        .filter_map(|(_, f)| f.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    if let Some(mut live) = std::fs::read(&index_path)
        .ok()
        .and_then(|b| serde_json::from_slice::<serde_json::Value>(&b).ok())
    {
        let mut redirected = false;
        if let Some(map) = live
            .get_mut("weight_map")
            .and_then(serde_json::Value::as_object_mut)
        {
            let mut aside_done = std::collections::HashSet::new();
            for value in map.values_mut() {
                let Some(name) = value.as_str().map(str::to_string) else {
                    continue;
                };
                if !new_names.contains(&name) {
                    continue;
                }
                let aside = format!("{name}{REPLACED}");
                if aside_done.insert(name.clone()) {
                    let (from, to) = (dir.join(&name), dir.join(&aside));
                    let _ = std::fs::remove_file(&to);
                    std::fs::hard_link(&from, &to)
                        .or_else(|_| std::fs::copy(&from, &to).map(|_| ()))
                        .map_err(io("keeping the previous shard as", &to))?;
                    after_step();
                }
                *value = serde_json::Value::String(aside);
                redirected = true;
            }
        }
        if redirected {
            sync_dir(dir)?;
            let text = serde_json::to_vec_pretty(&live).expect("JSON values");
            crate::fs::write_atomic(&index_path, &text)?;
            after_step();
        }
    }
    let mut written = Vec::new();
    for (tmp, path) in &staged {
        std::fs::rename(tmp, path).map_err(io("renaming into place", path))?;
        written.push(path.clone());
        after_step();
    }
    sync_dir(dir)?;
    match index {
        Some(text) => {
            crate::fs::write_atomic(&index_path, &text)?;
            written.push(index_path);
            after_step();
        }
        None => {
            if index_path.exists() {
                std::fs::remove_file(&index_path)
                    .map_err(io("removing the previous index", &index_path))?;
                sync_dir(dir)?;
                after_step();
            }
        }
    }
    // Remove what earlier saves left that this one does not use (stale shards, second names, temporaries).
    for entry in std::fs::read_dir(dir)
        .map_err(io("listing", dir))?
        .flatten()
    {
        let path = entry.path();
        let name = entry.file_name().to_string_lossy().to_string();
        if is_weight_file(&name) && !written.contains(&path) && path.is_file() {
            std::fs::remove_file(&path).map_err(io("removing a stale file", &path))?;
            after_step();
        }
    }
    sync_dir(dir)?;
    Ok(written)
}

/// How [`save_model_with`](crate::Accelerator::save_model_with) writes weights.
#[derive(Debug, Clone)]
pub struct SaveOptions {
    /// The largest shard, `"10GB"`, `"500MB"`, `"1GiB"` (default `"10GB"`).
    pub max_shard_size: String,
    /// safetensors (default `true`), or Burn's own `model.bpk` (keeps parameter ids; layout and remapping do
    /// not apply).
    pub safe_serialization: bool,
    /// The tensor layout (default PyTorch's; see [`WeightLayout`]).
    pub layout: WeightLayout,
    /// Renames keys as they are written (e.g. add a `model.` prefix a consumer expects).
    pub remap: KeyRemap,
}

impl Default for SaveOptions {
    fn default() -> Self {
        Self {
            max_shard_size: "10GB".into(),
            safe_serialization: true,
            layout: WeightLayout::default(),
            remap: KeyRemap::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::safetensors::read::{LoadOptions, load_weights};
    use burn::nn::{Initializer, Linear, LinearConfig};

    #[derive(Module, Debug)]
    struct Net {
        a: Linear,
        b: Linear,
        c: Linear,
    }

    fn net(value: f64) -> Net {
        let device = Default::default();
        let layer = || {
            LinearConfig::new(32, 32)
                .with_initializer(Initializer::Constant { value })
                .init(&device)
        };
        Net {
            a: layer(),
            b: layer(),
            c: layer(),
        }
    }

    /// The one value every parameter loaded from `dir` has, or `None` when the weights of two saves are mixed
    /// or the folder does not load.
    fn loaded_value(dir: &Path) -> Option<f32> {
        let options = LoadOptions {
            strict: true,
            ..LoadOptions::default()
        };
        let (model, _) = load_weights(net(0.0), dir, &options).ok()?;
        let mut values = Vec::new();
        for layer in [&model.a, &model.b, &model.c] {
            values.extend(layer.weight.val().into_data().iter::<f32>());
            values.extend(layer.bias.as_ref()?.val().into_data().iter::<f32>());
        }
        values.iter().all(|v| *v == values[0]).then(|| values[0])
    }

    #[test]
    fn every_instant_of_a_replacement_loads_the_old_or_the_new_weights_whole() {
        // One file (4.2 KB a layer, 12.7 KB in all), 3 shards of 4.2 KB, 2 shards (8.4 + 4.2 KB).
        let shardings = [1 << 30, 5_000, 9_000];
        for (before, after) in [(0, 0), (0, 1), (1, 1), (1, 2), (2, 2), (2, 0), (1, 0)] {
            let dir = std::env::temp_dir()
                .join(format!("ba-commit-{before}-{after}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            let (layout, remap) = (WeightLayout::PyTorch, KeyRemap::new());
            write_safetensors(&net(1.0), &dir, shardings[before], layout, &remap).unwrap();
            let mut seen = Vec::new();
            write_planned(
                plan(&net(2.0), layout, &remap, None).unwrap(),
                &dir,
                shardings[after],
                layout,
                &mut || seen.push(loaded_value(&dir)),
            )
            .unwrap();
            assert!(
                seen.iter().all(|v| *v == Some(1.0) || *v == Some(2.0)),
                "{before} -> {after}: {seen:?}"
            );
            assert_eq!(seen.last(), Some(&Some(2.0)), "{before} -> {after}");
            assert_eq!(loaded_value(&dir), Some(2.0));
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }
}
