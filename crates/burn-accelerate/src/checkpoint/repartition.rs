//! Records re-cut for another partition of the parameters: what lets a state saved by N ranks (or under another
//! strategy) load on M. A checkpoint's records are Burn's burnpack files, keyed by parameter id (optimizer
//! state) or module path (models); a sharded save holds one file per rank with that rank's dim-0 slices, and the
//! manifest says how each parameter was split ([`SavedSplits`]). Each rank reads the saved files one tensor at a
//! time (the files are read lazily) and copies out of each only the elements of its own slices; the assembled
//! record is written to a scratch file and loaded from there tensor by tensor, so no rank ever holds more than
//! its share and one tensor.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use burn::module::{Module, ParamId};
use burn::tensor::Bytes;
use burn_pack::{Reader, Writer};

use crate::fs::Scratch;
use serde::{Deserialize, Serialize};

use crate::distributed::strategy::{SliceKind, Slicing};
use crate::error::{Error, Result};

fn corrupt(path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::Checkpoint {
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

/// One saved record file: the rank that wrote it and its path (checked against its checksum where one was
/// recorded); its tensors are read from the file as they are needed.
pub(crate) type Source = (usize, PathBuf);

/// How one parameter was split when the checkpoint was saved, as its manifest records it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct SavedSplit {
    /// The parameter's id.
    pub id: u64,
    /// Its whole shape.
    pub dims: Vec<usize>,
    /// The ranks it was split over (a shard group: rank `k`'s file holds part `k % parts`).
    pub parts: usize,
    /// The rank holding it whole, or `None` where it was cut in rows.
    pub owner: Option<usize>,
    /// The saving ranks whose files hold its parts (a pipeline stage's ranks: the other stages' files hold an
    /// empty placeholder, or a stale copy of a parameter they do not train); `None`: every rank's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holders: Option<std::ops::Range<usize>>,
    /// The dimension the parameter is cut along: 0, or 1 for a 2-D weight split by columns (tensor parallelism),
    /// whose `dims` are then the weight's with the two swapped and whose parts are its columns.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub dim: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

impl SavedSplit {
    /// What `split` of parameter `id` saves, its parts cut along `dim` (see [`SavedSplit::dim`]).
    pub fn of(id: ParamId, split: &Slicing, dim: usize) -> Self {
        Self {
            id: id.val(),
            dims: split.dims().to_vec(),
            parts: split.parts(),
            owner: match split.kind() {
                SliceKind::Rows => None,
                SliceKind::Whole { owner } => Some(owner),
            },
            holders: None,
            dim,
        }
    }

    fn slicing(&self) -> Slicing {
        let kind = match self.owner {
            None => SliceKind::Rows,
            Some(owner) => SliceKind::Whole { owner },
        };
        Slicing::new(self.dims.clone(), self.parts, kind)
    }

    /// The layout alone (shape, parts, owner, dimension), to compare two runs' splits whatever their ids.
    pub fn layout(&self) -> (Vec<usize>, usize, Option<usize>, usize) {
        (self.dims.clone(), self.parts, self.owner, self.dim)
    }
}

/// One saved split: how, the ranks whose files hold its parts, the dimension its parts are cut along.
type Saved = (Slicing, Option<std::ops::Range<usize>>, usize);

/// The splits of a saved checkpoint, by saved parameter id, with the ranks whose files hold each one's parts.
#[derive(Debug, Default)]
pub(crate) struct SavedSplits(HashMap<u64, Saved>);

impl SavedSplits {
    /// The splits the manifest lists.
    pub fn new(saved: &[SavedSplit]) -> Self {
        Self(
            saved
                .iter()
                .map(|s| (s.id, (s.slicing(), s.holders.clone(), s.dim)))
                .collect(),
        )
    }

    /// How parameter `id` was split, if it was, and the dimension its parts are cut along.
    fn get(&self, id: u64) -> Option<(&Slicing, usize)> {
        self.0.get(&id).map(|(split, _, dim)| (split, *dim))
    }

    /// Whether rank `rank`'s file holds parameter `id`'s part (not a placeholder or a stale copy).
    fn held_by(&self, id: Option<u64>, rank: usize) -> bool {
        id.and_then(|id| self.0.get(&id))
            .and_then(|(_, holders, _)| holders.as_ref())
            .is_none_or(|holders| holders.contains(&rank))
    }
}

/// What this rank wants of one parameter's tensor: the whole, or its part `q` of `split`, cut along the
/// dimension the third field names (see [`SavedSplit::dim`]).
#[derive(Debug, Clone)]
pub(crate) enum Want {
    Whole,
    Part(Slicing, usize, usize),
    /// Nothing: the rank holds an empty placeholder of this shape (another pipeline stage's block).
    Placeholder(Vec<usize>),
}

fn reader(path: &Path, what: &str) -> Result<Reader> {
    Reader::from_file_exact(path).map_err(|e| {
        corrupt(
            path,
            format!("not a {what} record (truncated or corrupt?): {e}"),
        )
    })
}

/// The parameter id a key of an optimizer record belongs to: records key each parameter's state
/// `"{id}.{field}"` (scalars) and `"{id}"` (its module path).
fn key_id(key: &str) -> Option<u64> {
    key.split('.').next().and_then(|id| id.parse().ok())
}

/// One tensor being assembled from the saved pieces: this rank's wanted elements of the whole.
struct Assembly {
    /// The saved tensor's element type and parameter id (not the tensor: it may hold on to its whole file).
    dtype: burn_pack::DType,
    param_id: Option<u64>,
    dims: Vec<usize>,
    /// The elements of the whole this rank wants, and the buffer they go to (padding stays zero).
    wanted: std::ops::Range<usize>,
    bytes: Vec<u8>,
    filled: usize,
    /// The parts taken so far (the replicas of a hybrid strategy saved the same part: the first copy counts).
    parts: std::collections::HashSet<usize>,
    /// Whether the pieces were taken with the tensor's two dimensions swapped (a split by columns), to be swapped
    /// back once assembled.
    swapped: bool,
}

/// The pieces of each tensor found in the saved files, cut to what this rank wants.
#[derive(Default)]
struct Assembler {
    tensors: BTreeMap<String, Assembly>,
    /// Tensors that are not pieces of a split parameter: the first copy (every rank saved the same).
    whole: BTreeMap<String, burn_pack::Tensor>,
}

impl Assembler {
    /// Takes tensor `tensor` of rank `rank`'s file: a piece of a split parameter (its shape is that rank's part
    /// of the saved split) is cut to this rank's wanted elements; anything else is kept whole (first copy).
    fn take(
        &mut self,
        path: &Path,
        rank: usize,
        tensor: burn_pack::Tensor,
        saved: Option<(&Slicing, usize)>,
        want: &Want,
    ) -> Result<()> {
        // A split by columns (saved, or wanted of a whole tensor) is handled with its columns as rows.
        let want_dim = match want {
            Want::Part(_, _, dim) => *dim,
            _ => 0,
        };
        let swapped = match saved {
            Some((_, dim)) => dim == 1,
            None => want_dim == 1,
        };
        let tensor = match swapped {
            true => swap_2d(path, tensor)?,
            false => tensor,
        };
        let saved = saved.map(|(split, _)| split);
        if let Want::Placeholder(dims) = want {
            // Kept empty here, whatever the saving rank held; the saved id goes with it.
            let empty = burn_pack::Tensor::new(
                tensor.name.clone(),
                tensor.dtype,
                burn_pack::Shape::from(dims.clone()),
                tensor.param_id,
                Bytes::from_bytes_vec(Vec::new()),
            );
            self.whole.entry(tensor.name.clone()).or_insert(empty);
            return Ok(());
        }
        let shape: Vec<usize> = tensor.shape.to_vec();
        let elems: usize = shape.iter().product();
        let (split, part) = match saved {
            Some(split) if split.local_dims(rank % split.parts()) == shape => {
                (split.clone(), rank % split.parts())
            }
            // A placeholder saved by a rank that held none of it (an older checkpoint's owner layout).
            _ if elems == 0 && !shape.is_empty() => return Ok(()),
            _ => {
                if let (Want::Part(split, _, _), true) = (want, elems > 0) {
                    // A whole tensor (a replicated save) wanted as a slice: the whole is its only piece.
                    if split.dims() == shape {
                        let whole = Slicing::new(shape, 1, SliceKind::Whole { owner: 0 });
                        return self.piece(path, tensor, (&whole, 0), want, swapped);
                    }
                }
                self.whole.entry(tensor.name.clone()).or_insert(tensor);
                return Ok(());
            }
        };
        self.piece(path, tensor, (&split, part), want, swapped)
    }

    /// Copies what this rank wants of `tensor`, part `part` of `split` (`swapped`: taken with its two dimensions
    /// swapped).
    fn piece(
        &mut self,
        path: &Path,
        tensor: burn_pack::Tensor,
        (split, part): (&Slicing, usize),
        want: &Want,
        swapped: bool,
    ) -> Result<()> {
        if let Want::Part(target, _, _) = want
            && target.dims() != split.dims()
        {
            return Err(corrupt(
                path,
                format!(
                    "`{}` was saved with the shape {:?}, the model's is {:?}: it was saved from another model",
                    tensor.name,
                    split.dims(),
                    target.dims()
                ),
            ));
        }
        let name = tensor.name.clone();
        let size = tensor.dtype.size();
        // Every tensor met is assembled, even one this rank gets nothing of (padding, a placeholder).
        let assembly = self.tensors.entry(name.clone()).or_insert_with(|| {
            let (dims, wanted) = wanted_of(split.dims(), want);
            Assembly {
                dtype: tensor.dtype,
                param_id: tensor.param_id,
                bytes: vec![0u8; dims.iter().product::<usize>() * size],
                dims,
                wanted,
                filled: 0,
                parts: Default::default(),
                swapped,
            }
        });
        let held = split.held(part);
        let from = held.start.max(assembly.wanted.start);
        let to = held.end.min(assembly.wanted.end);
        // The first copy of a part counts; a part holding none of the wanted elements is not read.
        if !assembly.parts.insert(part) || from >= to {
            return Ok(());
        }
        let data = tensor
            .to_bytes()
            .map_err(|e| corrupt(path, format!("unreadable tensor `{name}`: {e}")))?;
        let src = (from - held.start) * size..(to - held.start) * size;
        let dst = (from - assembly.wanted.start) * size..(to - assembly.wanted.start) * size;
        if src.end > data.len() || dst.end > assembly.bytes.len() {
            return Err(corrupt(
                path,
                format!("`{name}` does not match the split the manifest records"),
            ));
        }
        assembly.bytes[dst].copy_from_slice(&data[src]);
        assembly.filled += to - from;
        Ok(())
    }

    /// Every assembled tensor, checked complete, and the whole ones.
    fn finish(self, last: &Path) -> Result<Vec<burn_pack::Tensor>> {
        let mut whole = self.whole;
        for name in self.tensors.keys() {
            whole.remove(name);
        }
        let mut out: Vec<burn_pack::Tensor> = whole.into_values().collect();
        for (name, a) in self.tensors {
            if a.filled != a.wanted.len() {
                return Err(corrupt(
                    last,
                    format!(
                        "the saved files hold {} of the {} elements of `{name}` this rank needs: the checkpoint \
                         is missing a rank's file",
                        a.filled,
                        a.wanted.len()
                    ),
                ));
            }
            let assembled = burn_pack::Tensor::new(
                name,
                a.dtype,
                burn_pack::Shape::from(a.dims),
                a.param_id,
                Bytes::from_bytes_vec(a.bytes),
            );
            out.push(match a.swapped {
                true => swap_2d(last, assembled)?,
                false => assembled,
            });
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }
}

/// `tensor`, a 2-D tensor `[a, b]`, with its two dimensions swapped: `[b, a]` (its columns as rows).
fn swap_2d(path: &Path, tensor: burn_pack::Tensor) -> Result<burn_pack::Tensor> {
    let dims: Vec<usize> = tensor.shape.to_vec();
    let [a, b] = dims[..] else {
        return Err(corrupt(
            path,
            format!(
                "`{}` is recorded as split by columns, but it has {} dimensions, not 2",
                tensor.name,
                dims.len()
            ),
        ));
    };
    let size = tensor.dtype.size();
    let data = tensor
        .to_bytes()
        .map_err(|e| corrupt(path, format!("unreadable tensor `{}`: {e}", tensor.name)))?;
    if data.len() != a * b * size {
        return Err(corrupt(
            path,
            format!("`{}` holds {} bytes for {dims:?}", tensor.name, data.len()),
        ));
    }
    let mut out = vec![0u8; data.len()];
    for i in 0..a {
        for j in 0..b {
            let (from, to) = ((i * b + j) * size, (j * a + i) * size);
            out[to..to + size].copy_from_slice(&data[from..from + size]);
        }
    }
    Ok(burn_pack::Tensor::new(
        tensor.name.clone(),
        tensor.dtype,
        burn_pack::Shape::from(vec![b, a]),
        tensor.param_id,
        Bytes::from_bytes_vec(out),
    ))
}

/// The shape of the tensor this rank assembles, and the elements of the whole it holds.
fn wanted_of(dims: &[usize], want: &Want) -> (Vec<usize>, std::ops::Range<usize>) {
    match want {
        Want::Whole => (dims.to_vec(), 0..dims.iter().product()),
        Want::Part(split, q, _) => (split.local_dims(*q), split.held(*q)),
        Want::Placeholder(dims) => (dims.clone(), 0..0),
    }
}

/// The optimizer state this rank steps, re-cut from every file of `sources` in turn: each state tensor of a split
/// parameter (`saved`, by saved id) is cut to what `want` says this rank holds of it (by the same id); the other
/// tensors and scalars are taken from the first file holding them. Returns the scratch file (beside `near`) the
/// record was written to, one tensor at a time.
pub(crate) fn optimizer_record(
    sources: impl IntoIterator<Item = Result<Source>>,
    saved: &SavedSplits,
    want: impl Fn(ParamId) -> Want,
    near: &Path,
) -> Result<Scratch> {
    let mut scalars = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    let mut assembler = Assembler::default();
    let mut last = PathBuf::new();
    for source in sources {
        let (rank, path) = source?;
        let reader = reader(&path, "optimizer")?;
        for (key, value) in reader.scalars() {
            scalars.entry(key.clone()).or_insert(*value);
        }
        for (key, value) in reader.metadata() {
            metadata.entry(key.clone()).or_insert(value.clone());
        }
        let read = reader
            .into_tensors()
            .map_err(|e| corrupt(&path, format!("unreadable optimizer record: {e}")))?;
        for tensor in read {
            let id = tensor.param_id.or_else(|| key_id(&tensor.name));
            if !saved.held_by(id, rank) {
                continue;
            }
            let split = id.and_then(|id| saved.get(id));
            let wanted = id.map_or(Want::Whole, |id| want(ParamId::from(id)));
            if matches!(wanted, Want::Placeholder(_)) {
                // The state of a parameter this rank holds nothing of (another pipeline stage's).
                continue;
            }
            assembler.take(&path, rank, tensor, split, &wanted)?;
        }
        last = path;
    }
    let mut writer = Writer::new(assembler.finish(&last)?);
    for (key, value) in &scalars {
        writer = writer.with_scalar(key, *value);
    }
    for (key, value) in &metadata {
        writer = writer.with_metadata(key, value);
    }
    write_scratch(writer, near, "optimizer")
}

/// `writer`'s record written to a new scratch file beside `near`, one tensor at a time.
fn write_scratch(writer: Writer, near: &Path, what: &str) -> Result<Scratch> {
    let scratch = Scratch::create(near, what)?;
    writer
        .auto_extension(false)
        .write_to_file_in_place(scratch.path())
        .map_err(|e| {
            crate::error::io("writing", scratch.path())(std::io::Error::other(e.to_string()))
        })?;
    Ok(scratch)
}

/// Hands every tensor of the model records in `sources` to `take` (with its file and saving rank), one file at a
/// time; returns the last file read.
fn each_model_tensor(
    sources: impl IntoIterator<Item = Result<Source>>,
    mut take: impl FnMut(&Path, usize, burn_pack::Tensor) -> Result<()>,
) -> Result<PathBuf> {
    let mut last = PathBuf::new();
    for source in sources {
        let (rank, path) = source?;
        let read = reader(&path, "model")?
            .into_tensors()
            .map_err(|e| corrupt(&path, format!("unreadable model record: {e}")))?;
        for tensor in read {
            take(&path, rank, tensor)?;
        }
        last = path;
    }
    Ok(last)
}

/// Every tensor of the model records in `sources` whole, joined from the ranks' slices (`merge-weights`).
pub(crate) fn whole_tensors(
    sources: impl IntoIterator<Item = Result<Source>>,
    saved: &SavedSplits,
) -> Result<Vec<burn_pack::Tensor>> {
    let mut assembler = Assembler::default();
    let last = each_model_tensor(sources, |path, rank, tensor| {
        if !saved.held_by(tensor.param_id, rank) {
            return Ok(());
        }
        let split = tensor.param_id.and_then(|id| saved.get(id));
        assembler.take(path, rank, tensor, split, &Want::Whole)
    })?;
    assembler.finish(&last)
}

/// A model record for `target` assembled from `sources` (each a saved record of the same model, or one rank's
/// slices of it): each parameter cut to what `want` says this rank holds of it (by `target`'s ids). Returns the
/// scratch file (beside `near`) the record was written to, one tensor at a time.
pub(crate) fn model_record<M: Module>(
    sources: impl IntoIterator<Item = Result<Source>>,
    target: &M,
    saved: &SavedSplits,
    want: impl Fn(ParamId) -> Want,
    near: &Path,
) -> Result<Scratch> {
    let mut wanted: HashMap<String, Want> = HashMap::new();
    crate::named_params::walk(target, |p| {
        let want = match p.kind {
            // An empty placeholder (another pipeline stage's parameter; under a sharded stage, its "slice" of
            // nothing) stays one; an empty slice of a parameter this rank holds parts of is the same nothing.
            crate::named_params::Kind::Float(param)
                if param.num_elements() == 0 && !param.dims().is_empty() =>
            {
                Want::Placeholder(param.dims())
            }
            crate::named_params::Kind::Float(param) => want(param.id()),
            _ => Want::Whole,
        };
        wanted.insert(p.name(), want);
    });
    let mut assembler = Assembler::default();
    let last = each_model_tensor(sources, |path, rank, tensor| {
        let Some(want) = wanted.get(&tensor.name) else {
            return Err(corrupt(
                path,
                format!(
                    "holds `{}`, which the model has no parameter for: it was saved from another model",
                    tensor.name
                ),
            ));
        };
        if !saved.held_by(tensor.param_id, rank) {
            return Ok(());
        }
        let split = tensor.param_id.and_then(|id| saved.get(id));
        assembler.take(path, rank, tensor, split, want)
    })?;
    let tensors = assembler.finish(&last)?;
    if let Some(name) = wanted
        .keys()
        .find(|name| !tensors.iter().any(|t| &t.name == *name))
    {
        return Err(corrupt(
            &last,
            format!("holds nothing for the model's `{name}`: it was saved from another model"),
        ));
    }
    write_scratch(Writer::new(tensors), near, "model")
}
