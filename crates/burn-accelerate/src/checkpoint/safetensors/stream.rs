//! Writing a safetensors file tensor by tensor, large tensors in bands, without a whole copy of the weights on
//! the host.
//!
//! A large parameter is read in bands of about [`BAND_BYTES`] along its stored first dimension, each band
//! already in the stored layout (a Linear weight saved in PyTorch's layout is read as bands of columns), and
//! handed to a writer thread, which writes it while the next band is read. A tensor of the Flex (CPU) backend
//! is read in place: bands in its own layout are written straight from its memory, transposed bands are
//! copied once by this crate's blocked transpose; tensors of other backends are read band by band through
//! Burn (from a GPU, that is the copy to the host). The writer asks the disk to start writing every few
//! megabytes (`sync_file_range` on Linux), so the final sync finds most of the file on disk. So the memory a
//! save needs is a few bands (at most four), not the model: on CPU backends fresh allocations of the model's
//! size cost more than the writing (every new page is faulted in), and a 10 GB model does not need 10 GB free
//! to be saved. The bytes are those the `safetensors` crate writes for the same tensors (same header, same
//! order).

use std::collections::HashMap;
use std::io::Write;
use std::ops::Range;
use std::path::Path;

use burn::tensor::{DType, Tensor, TensorData};
use safetensors::tensor::{Dtype, Metadata, TensorInfo};

use crate::error::{Error, Result};
use crate::fs::{io, start_writeback};

/// Size of the bands a large tensor is read and written in: large enough that each read costs little more
/// than its copy, small enough to stay in cache and to reuse the allocator's memory from band to band.
pub(crate) const BAND_BYTES: usize = 4 << 20;

/// Reads the rows `range` of a tensor's stored first dimension, in the stored layout (`true`: the tensor is
/// stored transposed, so its stored rows are the columns of the 2-D tensor).
pub(crate) type BandReader = Box<dyn Fn(bool, Range<usize>) -> std::result::Result<Band, String>>;

/// The bytes of one band of a tensor, in the stored layout.
pub(crate) enum Band {
    /// Copied out of the tensor (read back from a device, or transposed).
    Copied(TensorData),
    /// Borrowed in place from the host memory of a CPU tensor: `memory[range]`, not copied.
    #[cfg(feature = "flex")]
    Shared(std::sync::Arc<burn::tensor::Bytes>, Range<usize>),
}

impl Band {
    fn as_bytes(&self) -> &[u8] {
        match self {
            Band::Copied(data) => data.as_bytes(),
            #[cfg(feature = "flex")]
            Band::Shared(memory, range) => &memory[range.clone()],
        }
    }
}

/// A reader of bands of `tensor` (see [`BandReader`]).
pub(crate) fn band_reader<const D: usize>(tensor: Tensor<D>) -> BandReader {
    host_band_reader(&tensor).unwrap_or_else(|| device_band_reader(tensor))
}

/// A reader of bands of `tensor` through Burn, for any backend: each band is narrowed (and transposed) by the
/// backend and copied to the host.
fn device_band_reader<const D: usize>(tensor: Tensor<D>) -> BandReader {
    Box::new(move |transposed, range| {
        let band = if transposed {
            // Only 2-D tensors are stored transposed: columns `range`, as rows.
            tensor
                .clone()
                .narrow(1, range.start, range.len())
                .transpose()
        } else {
            tensor.clone().narrow(0, range.start, range.len())
        };
        band.try_into_data()
            .map(Band::Copied)
            .map_err(|e| e.to_string())
    })
}

/// For a contiguous tensor of the Flex (CPU) backend, a reader of bands straight from its memory: bands in the
/// tensor's own layout are written from it without a copy, transposed bands are copied once by
/// [`transposed_columns`] (Flex's own strided copy is several times slower). `None` for other tensors.
#[cfg(feature = "flex")]
fn host_band_reader<const D: usize>(tensor: &Tensor<D>) -> Option<BandReader> {
    use super::layout::{Parallel, transposed_columns};
    use burn::backend::Flex;
    let flex = tensor.clone().try_into_primitive::<Flex>().ok()?;
    let layout = flex.layout();
    let dtype = flex.dtype();
    let shape = layout.shape().to_vec();
    if shape.is_empty() || !layout.is_contiguous() {
        return None;
    }
    let start = layout.start_offset() * dtype.size();
    let len = shape.iter().product::<usize>() * dtype.size();
    let memory = flex.data_arc();
    if memory.len() < start + len {
        return None;
    }
    let row = len / shape[0].max(1);
    Some(Box::new(move |transposed, range| {
        if !transposed {
            return Ok(Band::Shared(
                memory.clone(),
                start + range.start * row..start + range.end * row,
            ));
        }
        match shape[..] {
            // On this thread only: the writer thread has the other core.
            [rows, cols] => Ok(Band::Copied(transposed_columns(
                &memory[start..start + len],
                (rows, cols),
                dtype,
                range,
                Parallel::No,
            ))),
            _ => Err(format!(
                "only 2-D tensors are stored transposed, not shape {shape:?}"
            )),
        }
    }))
}

#[cfg(not(feature = "flex"))]
fn host_band_reader<const D: usize>(_tensor: &Tensor<D>) -> Option<BandReader> {
    None
}

/// Where the bytes of a tensor to be written come from.
pub(crate) enum Content {
    /// Already on the host, in the stored layout.
    Host(TensorData),
    /// Read from the device band by band when the file is written.
    Bands {
        read: BandReader,
        /// Whether the bands are read transposed (see [`BandReader`]).
        transposed: bool,
    },
}

/// One tensor of a file to be written: its key, dtype and shape as stored, and its bytes.
pub(crate) struct TensorToWrite {
    pub key: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub content: Content,
    /// Whether its first band fetches it from another rank (`FULL_SHARD`), a collective.
    pub fetched: bool,
}

impl TensorToWrite {
    /// Number of bytes the tensor takes in the file.
    pub fn byte_len(&self) -> usize {
        match &self.content {
            Content::Host(data) => data.as_bytes().len(),
            Content::Bands { .. } => self.shape.iter().product::<usize>() * self.dtype.size(),
        }
    }
}

/// The safetensors name of a Burn dtype (`None` for quantized tensors, which safetensors cannot hold).
pub(crate) fn safetensors_dtype(dtype: DType) -> Option<Dtype> {
    Some(match dtype {
        DType::F64 => Dtype::F64,
        DType::F32 | DType::Flex32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::I64 => Dtype::I64,
        DType::I32 => Dtype::I32,
        DType::I16 => Dtype::I16,
        DType::I8 => Dtype::I8,
        DType::U64 => Dtype::U64,
        DType::U32 => Dtype::U32,
        DType::U16 => Dtype::U16,
        DType::U8 => Dtype::U8,
        DType::Bool(_) => Dtype::BOOL,
        DType::QFloat(_) => return None,
    })
}

/// `tensors` in the order a file holds (and [`write_file`] reads) them, as the `safetensors` crate lays them out:
/// by descending dtype, then by key.
pub(crate) fn file_order<'t>(
    tensors: &[&'t TensorToWrite],
) -> Result<Vec<(&'t TensorToWrite, Dtype)>> {
    let mut order: Vec<(&TensorToWrite, Dtype)> = Vec::with_capacity(tensors.len());
    for t in tensors {
        let dtype = safetensors_dtype(t.dtype).ok_or_else(|| {
            Error::InvalidArgument(format!(
                "save_model: tensor `{}` is quantized; dequantize it first",
                t.key
            ))
        })?;
        order.push((t, dtype));
    }
    order.sort_by(|(l, ld), (r, rd)| rd.cmp(ld).then_with(|| l.key.cmp(&r.key)));
    Ok(order)
}

/// Writes `tensors` with `metadata` as a safetensors file into `file` (at `path`, for messages), then syncs
/// it. The tensors are laid out as the `safetensors` crate lays them out: by descending dtype, then by key.
pub(crate) fn write_file(
    file: std::fs::File,
    path: &Path,
    tensors: &[&TensorToWrite],
    metadata: HashMap<String, String>,
) -> Result<()> {
    let order = file_order(tensors)?;
    let mut infos = Vec::with_capacity(order.len());
    let mut offset = 0;
    for (t, dtype) in &order {
        let n = t.byte_len();
        infos.push((
            t.key.clone(),
            TensorInfo {
                dtype: *dtype,
                shape: t.shape.clone(),
                data_offsets: (offset, offset + n),
            },
        ));
        offset += n;
    }
    let invalid = |e: &dyn std::fmt::Display| {
        Error::InvalidArgument(format!("save_model: writing {}: {e}", path.display()))
    };
    // The `safetensors` crate writes `__metadata__` first, in a hash map's order: the same weights would give
    // files that differ from save to save. Here its keys are sorted, so equal weights give equal files.
    let tensors = Metadata::new(None, infos).map_err(|e| invalid(&e))?;
    let tensors = serde_json::to_string(&tensors).map_err(|e| invalid(&e))?;
    let sorted: std::collections::BTreeMap<&String, &String> = metadata.iter().collect();
    let sorted = serde_json::to_string(&sorted).map_err(|e| invalid(&e))?;
    let rest = tensors.strip_prefix('{').unwrap_or(&tensors);
    let separator = if rest == "}" { "" } else { "," };
    let mut header = format!("{{\"__metadata__\":{sorted}{separator}{rest}").into_bytes();
    header.resize(header.len().next_multiple_of(8), b' ');

    // The bands are read here (where the tensors live: GPU backends bind their context to a thread) while a
    // writer thread writes the previous ones: reading and writing overlap, and at most a few bands wait.
    std::thread::scope(|scope| {
        let (send, receive) = std::sync::mpsc::sync_channel::<Chunk<'_>>(2);
        let writer = std::thread::Builder::new()
            .name("save_model writer".into())
            .spawn_scoped(scope, move || write_chunks(file, path, receive))
            .map_err(io("starting a writer thread for", path))?;
        let read = read_chunks(&order, header, &send);
        drop(send);
        let written = writer.join().unwrap_or_else(|_| {
            Err(Error::InvalidArgument(format!(
                "save_model: the thread writing {} panicked",
                path.display()
            )))
        });
        // A read error explains a short file better than the writer's view of it; a write error stops the
        // reading early (the channel closes), and is the one to report then.
        read.and(written)
    })
}

/// The writer asks the disk to start writing every this many bytes, so that the disk works while the rest of
/// the file is prepared and the final sync has little left to wait for.
const WRITEBACK_BYTES: u64 = 8 << 20;

/// A piece of the file, in order.
enum Chunk<'a> {
    Owned(Vec<u8>),
    Borrowed(&'a [u8]),
    Band(Band),
}

/// Sends the header, then every tensor's bytes (large ones band by band), to the writer. Stops early, without
/// an error, when the writer has stopped (it reports why).
fn read_chunks<'a>(
    order: &[(&'a TensorToWrite, Dtype)],
    header: Vec<u8>,
    send: &std::sync::mpsc::SyncSender<Chunk<'a>>,
) -> Result<()> {
    let mut start_of_file = (header.len() as u64).to_le_bytes().to_vec();
    start_of_file.extend_from_slice(&header);
    if send.send(Chunk::Owned(start_of_file)).is_err() {
        return Ok(());
    }
    for (t, _) in order {
        match &t.content {
            Content::Host(data) => {
                if send.send(Chunk::Borrowed(data.as_bytes())).is_err() {
                    return Ok(());
                }
            }
            Content::Bands { read, transposed } => {
                let rows = t.shape.first().copied().unwrap_or(1);
                let row_bytes = t.shape.iter().skip(1).product::<usize>() * t.dtype.size();
                let per_band = (BAND_BYTES / row_bytes.max(1)).max(1);
                let mut start = 0;
                while start < rows {
                    let range = start..(start + per_band).min(rows);
                    let expected = range.len() * row_bytes;
                    let band =
                        read(*transposed, range.clone()).map_err(|reason| Error::Execution {
                            operation: "save_model",
                            device: format!("reading `{}`", t.key),
                            reason,
                        })?;
                    let dtype = match &band {
                        Band::Copied(data) => data.dtype(),
                        #[cfg(feature = "flex")]
                        Band::Shared(..) => t.dtype,
                    };
                    if dtype != t.dtype || band.as_bytes().len() != expected {
                        return Err(Error::InvalidArgument(format!(
                            "save_model: rows {range:?} of `{}` read back as {} bytes of {dtype:?}, expected \
                             {expected} bytes of {:?}",
                            t.key,
                            band.as_bytes().len(),
                            t.dtype
                        )));
                    }
                    if send.send(Chunk::Band(band)).is_err() {
                        return Ok(());
                    }
                    start = range.end;
                }
            }
        }
    }
    Ok(())
}

/// Writes the chunks to `file` in the order they come, then syncs it.
fn write_chunks(
    file: std::fs::File,
    path: &Path,
    receive: std::sync::mpsc::Receiver<Chunk<'_>>,
) -> Result<()> {
    let mut out = std::io::BufWriter::with_capacity(1 << 20, file);
    // Bytes written, and how many of them the disk has been asked to write already.
    let (mut written, mut started) = (0u64, 0u64);
    for chunk in receive {
        let bytes = match &chunk {
            Chunk::Owned(bytes) => bytes.as_slice(),
            Chunk::Borrowed(bytes) => bytes,
            Chunk::Band(band) => band.as_bytes(),
        };
        out.write_all(bytes).map_err(io("writing", path))?;
        written += bytes.len() as u64;
        if written - started >= WRITEBACK_BYTES {
            out.flush().map_err(io("writing", path))?;
            start_writeback(out.get_ref(), started, written - started);
            started = written;
        }
    }
    let file = out
        .into_inner()
        .map_err(|e| io("writing", path)(e.into_error()))?;
    file.sync_all().map_err(io("syncing", path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    /// A folder removed when the test ends.
    struct TempDir(std::path::PathBuf);
    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("ba-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn stored(
        key: &str,
        tensor: Tensor<2>,
        transposed: bool,
        reader: fn(Tensor<2>) -> BandReader,
    ) -> TensorToWrite {
        let dims = tensor.dims();
        TensorToWrite {
            key: key.into(),
            dtype: tensor.dtype(),
            shape: if transposed {
                vec![dims[1], dims[0]]
            } else {
                dims.to_vec()
            },
            content: Content::Bands {
                read: reader(tensor),
                transposed,
            },
            fetched: false,
        }
    }

    /// Bands of every shape (one row wider than a band, several bands, a last partial band, transposed or
    /// not) give the bytes the `safetensors` crate writes for the same tensors.
    #[test]
    fn banded_files_are_the_safetensors_crates_bytes() {
        // In place from a CPU tensor's memory where the backend allows it, and through Burn's own reads.
        banded_file_matches_the_reference("host", band_reader);
        banded_file_matches_the_reference("device", device_band_reader);
    }

    fn banded_file_matches_the_reference(name: &str, reader: fn(Tensor<2>) -> BandReader) {
        let device = Device::default();
        let dir = TempDir::new(&format!("stream-bands-{name}"));
        let row = BAND_BYTES / 4;
        let cases = [
            ("wide", [3, row + 5], false),
            ("bands", [(BAND_BYTES / 4 / 100) * 2 + 37, 100], false),
            ("columns", [100, (BAND_BYTES / 4 / 100) * 2 + 37], true),
            ("small", [3, 2], true),
        ];
        let mut ours = Vec::new();
        let mut reference: Vec<(String, TensorData)> = Vec::new();
        for (i, (key, shape, transposed)) in cases.into_iter().enumerate() {
            let n = shape[0] * shape[1];
            let values: Vec<f32> = (0..n).map(|v| (v * 7 + i) as f32 * 0.25).collect();
            let tensor = Tensor::<2>::from_data(TensorData::new(values, shape), &device);
            let data = if transposed {
                tensor.clone().transpose().into_data()
            } else {
                tensor.clone().into_data()
            };
            reference.push((key.into(), data));
            ours.push(stored(key, tensor, transposed, reader));
        }
        ours.push(TensorToWrite {
            key: "ints".into(),
            dtype: DType::I64,
            shape: vec![3],
            content: Content::Host(TensorData::new(vec![1i64, -2, 3], [3])),
            fetched: false,
        });
        reference.push(("ints".into(), TensorData::new(vec![1i64, -2, 3], [3])));
        let metadata: HashMap<String, String> = [("format".to_string(), "pt".to_string())].into();

        let path = dir.path().join("ours.safetensors");
        let file = std::fs::File::create(&path).unwrap();
        write_file(
            file,
            &path,
            &ours.iter().collect::<Vec<_>>(),
            metadata.clone(),
        )
        .unwrap();
        let views: Vec<_> = reference
            .iter()
            .map(|(k, d)| {
                let view = safetensors::tensor::TensorView::new(
                    safetensors_dtype(d.dtype()).unwrap(),
                    d.shape().to_vec(),
                    d.as_bytes(),
                )
                .unwrap();
                (k.clone(), view)
            })
            .collect();
        let expected = safetensors::serialize(views, Some(metadata)).unwrap();
        let written = std::fs::read(&path).unwrap();
        assert_eq!(written.len(), expected.len());
        assert!(
            written == expected,
            "the banded file ({name} reads) differs from the reference"
        );
    }

    /// A band that comes back with the wrong size is an error naming the tensor, not a corrupt file.
    #[test]
    fn a_band_of_the_wrong_size_is_an_error() {
        let dir = TempDir::new("stream-bad");
        let path = dir.path().join("bad.safetensors");
        let bad = TensorToWrite {
            key: "layer.weight".into(),
            dtype: DType::F32,
            shape: vec![4, 4],
            content: Content::Bands {
                read: Box::new(|_, _| Ok(Band::Copied(TensorData::new(vec![0f32; 3], [3])))),
                transposed: false,
            },
            fetched: false,
        };
        let file = std::fs::File::create(&path).unwrap();
        let err = write_file(file, &path, &[&bad], HashMap::new())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("layer.weight") && err.contains("12 bytes"),
            "{err}"
        );
    }

    /// Equal weights give equal files: the metadata's keys do not come out in a hash map's order.
    #[test]
    fn equal_weights_give_equal_files_whatever_the_metadata_order() {
        let dir = TempDir::new("stream-order");
        let tensor = TensorToWrite {
            key: "w".into(),
            dtype: DType::F32,
            shape: vec![2],
            content: Content::Host(TensorData::new(vec![1f32, 2.0], [2])),
            fetched: false,
        };
        let keys = ["format", "layout", "a", "z", "m"];
        let files: Vec<Vec<u8>> = (0..8)
            .map(|i| {
                // Each map has its own random hashing, so an unsorted header would differ between them.
                let metadata: HashMap<String, String> = keys
                    .iter()
                    .map(|k| (k.to_string(), format!("v{k}")))
                    .collect();
                let path = dir.path().join(format!("{i}.safetensors"));
                write_file(
                    std::fs::File::create(&path).unwrap(),
                    &path,
                    &[&tensor],
                    metadata,
                )
                .unwrap();
                std::fs::read(&path).unwrap()
            })
            .collect();
        assert!(files.iter().all(|f| f == &files[0]));
        let (_, header) = safetensors::SafeTensors::read_metadata(&files[0]).unwrap();
        let read = header.metadata().clone().unwrap();
        assert_eq!(read.len(), keys.len());
        assert_eq!(read["layout"], "vlayout");
    }
}
