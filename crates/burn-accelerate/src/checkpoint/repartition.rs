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

use super::pieces::{Piece, Run, shared};
use crate::distributed::strategy::{CheckpointCut, SliceKind, Slicing};
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
    /// The ranks it was split over (a shard group: rank `k`'s file holds part `(k / stride) % parts`).
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
    /// How far apart the ranks of the split are: 1 where they are consecutive, `tp_size` for the data-parallel
    /// ranks of a tensor-parallel run.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub stride: usize,
    /// Each part split again (FSDP2 over a tensor-parallel part: a 2-D split), or `None`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub within: Option<SavedWithin>,
}

/// The second split of a [`SavedSplit`]'s parts: rank `k`'s file holds piece `(k / stride) % parts` of its part
/// (the part in its own shape, Burn's layout, cut in rows or owned whole).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub(crate) struct SavedWithin {
    /// The ranks each part is split over.
    pub parts: usize,
    /// The rank holding a part whole, or `None` where it was cut in rows.
    pub owner: Option<usize>,
    /// How far apart those ranks are.
    pub stride: usize,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

fn one() -> usize {
    1
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

fn kind_of(owner: Option<usize>) -> SliceKind {
    match owner {
        None => SliceKind::Rows,
        Some(owner) => SliceKind::Whole { owner },
    }
}

fn owner_of(kind: SliceKind) -> Option<usize> {
    match kind {
        SliceKind::Rows => None,
        SliceKind::Whole { owner } => Some(owner),
    }
}

/// The layout of a split alone (see [`SavedSplit::layout`]).
pub(crate) type SplitLayout = (
    Vec<usize>,
    usize,
    Option<usize>,
    usize,
    usize,
    Option<SavedWithin>,
);

impl SavedSplit {
    /// What `cut` of parameter `id` saves.
    pub fn of(id: ParamId, cut: &CheckpointCut) -> Self {
        Self {
            id: id.val(),
            dims: cut.split.dims().to_vec(),
            parts: cut.split.parts(),
            owner: owner_of(cut.split.kind()),
            holders: None,
            dim: cut.dim,
            stride: cut.stride,
            within: cut.within.as_ref().map(|w| SavedWithin {
                parts: w.split.parts(),
                owner: owner_of(w.split.kind()),
                stride: w.stride,
            }),
        }
    }

    fn slicing(&self) -> Slicing {
        Slicing::new(self.dims.clone(), self.parts, kind_of(self.owner))
    }

    /// The piece rank `rank`'s file holds, and which (its part, and its piece of the part).
    fn piece(&self, rank: usize) -> (Piece, (usize, usize)) {
        let part = (rank / self.stride.max(1)) % self.parts.max(1);
        let within = self.within.as_ref().map(|w| {
            let q = (rank / w.stride.max(1)) % w.parts.max(1);
            (w.parts, kind_of(w.owner), q)
        });
        let q = within.map_or(0, |(_, _, q)| q);
        (
            Piece::cut(&self.slicing(), part, self.dim, within),
            (part, q),
        )
    }

    /// The layout alone (shape, parts, owner, dimension, stride, second split), to compare two runs' splits
    /// whatever their ids.
    pub fn layout(&self) -> SplitLayout {
        (
            self.dims.clone(),
            self.parts,
            self.owner,
            self.dim,
            self.stride,
            self.within.clone(),
        )
    }
}

/// The splits of a saved checkpoint, by saved parameter id.
#[derive(Debug, Default)]
pub(crate) struct SavedSplits(HashMap<u64, SavedSplit>);

impl SavedSplits {
    /// The splits the manifest lists.
    pub fn new(saved: &[SavedSplit]) -> Self {
        Self(saved.iter().map(|s| (s.id, s.clone())).collect())
    }

    /// How parameter `id` was split, if it was.
    fn get(&self, id: u64) -> Option<&SavedSplit> {
        self.0.get(&id)
    }

    /// Whether rank `rank`'s file holds parameter `id`'s part (not a placeholder or a stale copy).
    fn held_by(&self, id: Option<u64>, rank: usize) -> bool {
        id.and_then(|id| self.0.get(&id))
            .and_then(|split| split.holders.as_ref())
            .is_none_or(|holders| holders.contains(&rank))
    }
}

/// What this rank wants of one parameter's tensor: the whole, or its part as the strategy holds it.
#[derive(Debug, Clone)]
pub(crate) enum Want {
    Whole,
    Part(CheckpointCut),
    /// Nothing: the rank holds an empty placeholder of this shape (another pipeline stage's block).
    Placeholder(Vec<usize>),
}

impl Want {
    /// The piece wanted of a tensor of whole shape `whole` (for `Whole`; a part knows its own).
    fn piece(&self, whole: &[usize]) -> Piece {
        match self {
            Want::Part(cut) => Piece::cut(
                &cut.split,
                cut.part,
                cut.dim,
                cut.within
                    .as_ref()
                    .map(|w| (w.split.parts(), w.split.kind(), w.piece)),
            ),
            _ => Piece::whole(whole.to_vec()),
        }
    }
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

/// One tensor being assembled from the saved pieces: this rank's wanted piece of the whole.
struct Assembly {
    /// The saved tensor's element type and parameter id (not the tensor: it may hold on to its whole file).
    dtype: burn_pack::DType,
    param_id: Option<u64>,
    /// The wanted piece's shape, its runs of the whole and their number of elements, and its buffer (padding
    /// stays zero).
    dims: Vec<usize>,
    runs: Vec<Run>,
    wanted: usize,
    bytes: Vec<u8>,
    filled: usize,
    /// The pieces taken so far, by part and piece of it (the replicas of a hybrid strategy saved the same piece:
    /// the first copy counts).
    pieces: std::collections::HashSet<(usize, usize)>,
}

/// The pieces of each tensor found in the saved files, cut to what this rank wants.
#[derive(Default)]
struct Assembler {
    tensors: BTreeMap<String, Assembly>,
    /// Tensors that are not pieces of a split parameter: the first copy (every rank saved the same).
    whole: BTreeMap<String, burn_pack::Tensor>,
}

impl Assembler {
    /// Takes tensor `tensor` of rank `rank`'s file: a piece of a split parameter (its shape is that rank's piece
    /// of the saved split) gives this rank's wanted elements of it; anything else is kept whole (first copy).
    fn take(
        &mut self,
        path: &Path,
        rank: usize,
        tensor: burn_pack::Tensor,
        saved: Option<&SavedSplit>,
        want: &Want,
    ) -> Result<()> {
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
        let piece = saved
            .map(|split| split.piece(rank))
            .filter(|(piece, _)| piece.dims() == shape);
        let (piece, key) = match piece {
            Some(piece) => piece,
            // A placeholder saved by a rank that held none of it (an older checkpoint's owner layout).
            None if elems == 0 && !shape.is_empty() => return Ok(()),
            // A whole tensor (a replicated save) wanted as a part: the whole is its only piece.
            None if matches!(want, Want::Part(_))
                && elems > 0
                && want.piece(&shape).whole == shape =>
            {
                (Piece::whole(shape), (usize::MAX, usize::MAX))
            }
            None => {
                self.whole.entry(tensor.name.clone()).or_insert(tensor);
                return Ok(());
            }
        };
        self.piece(path, tensor, (&piece, key), want)
    }

    /// Copies what this rank wants of `tensor`, the saved piece `piece` (`key`: its part and piece of it).
    fn piece(
        &mut self,
        path: &Path,
        tensor: burn_pack::Tensor,
        (piece, key): (&Piece, (usize, usize)),
        want: &Want,
    ) -> Result<()> {
        let name = tensor.name.clone();
        let wanted = want.piece(&piece.whole);
        if wanted.whole != piece.whole {
            return Err(corrupt(
                path,
                format!(
                    "`{name}` was saved with the shape {:?}, the model's is {:?}: it was saved from another model",
                    piece.whole, wanted.whole
                ),
            ));
        }
        let size = tensor.dtype.size();
        let runs = |p: &Piece| {
            p.runs()
                .map_err(|e| corrupt(path, format!("`{name}`: {e}")))
        };
        // Every tensor met is assembled, even one this rank gets nothing of (padding, a placeholder).
        if !self.tensors.contains_key(&name) {
            let runs = runs(&wanted)?;
            let dims = wanted.dims();
            self.tensors.insert(
                name.clone(),
                Assembly {
                    dtype: tensor.dtype,
                    param_id: tensor.param_id,
                    bytes: vec![0u8; dims.iter().product::<usize>() * size],
                    dims,
                    wanted: runs.iter().map(|r| r.len).sum(),
                    runs,
                    filled: 0,
                    pieces: Default::default(),
                },
            );
        }
        let saved_runs = runs(piece)?;
        let Some(assembly) = self.tensors.get_mut(&name) else {
            return Ok(());
        };
        // The first copy of a piece counts; a piece holding none of the wanted elements is not read.
        let copies = shared(&saved_runs, &assembly.runs);
        if !assembly.pieces.insert(key) || copies.is_empty() {
            return Ok(());
        }
        let data = tensor
            .to_bytes()
            .map_err(|e| corrupt(path, format!("unreadable tensor `{name}`: {e}")))?;
        for (from, to, len) in copies {
            let (src, dst) = (
                from * size..(from + len) * size,
                to * size..(to + len) * size,
            );
            if src.end > data.len() || dst.end > assembly.bytes.len() {
                return Err(corrupt(
                    path,
                    format!("`{name}` does not match the split the manifest records"),
                ));
            }
            assembly.bytes[dst].copy_from_slice(&data[src]);
            assembly.filled += len;
        }
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
            if a.filled != a.wanted {
                return Err(corrupt(
                    last,
                    format!(
                        "the saved files hold {} of the {} elements of `{name}` this rank needs: the checkpoint \
                         is missing a rank's file",
                        a.filled, a.wanted
                    ),
                ));
            }
            out.push(burn_pack::Tensor::new(
                name,
                a.dtype,
                burn_pack::Shape::from(a.dims),
                a.param_id,
                Bytes::from_bytes_vec(a.bytes),
            ));
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
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
