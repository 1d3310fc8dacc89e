//! Text classification with dynamic padding: Accelerate's `nlp_example.py`, in Burn.
//!
//! A bag-of-embeddings sentiment classifier on `examples/data/reviews.tsv` (1,200 short reviews kept in the
//! repository). Each batch is padded to its own longest review (dynamic padding), so ranks hold batches of
//! different widths; evaluation pads them to a common width with `pad_across_processes` and gathers
//! predictions, labels and token ids in one `gather_for_metrics` call, every review counted exactly once.
//!
//! ```text
//! cargo run --release --example nlp_example                        # one process
//! cargo run --release --example nlp_example -- --processes 2       # two in-process ranks, same accuracy
//! burn-accelerate launch --num-processes 2 target/release/examples/nlp_example   # built with --features mpi
//! ```
//!
//! Reviews are read from the data file when a batch needs them, and tokenised then, on the loader's worker
//! threads (`--workers`, default 2), so nothing but an index of line offsets is held in memory: the pattern for a
//! dataset too large to load (the built-in copy of the file stands in when the repository's is not there).
//!
//! Prints `accuracy=<x>` and `final_loss=<y>` over the 240 held-out reviews.

#[path = "support/ranks.rs"]
mod ranks;

use std::collections::BTreeMap;
use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;
use std::sync::Arc;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig, Relu};
use burn::optim::AdamConfig;
use burn::tensor::activation::log_softmax;
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::data::{DataLoaderBuilder, PreparedDataLoader};
use burn_accelerate::{Accelerator, Error, MixedPrecision, Result, impl_to_device};
use clap::Parser;

const PAD: i64 = 0;
const UNKNOWN: i64 = 1;
const TRAIN: usize = 960;

#[derive(Parser, Debug, Clone)]
struct Args {
    /// In-process ranks (ignored under a launcher, which decides).
    #[arg(long, default_value_t = 1)]
    processes: usize,
    /// Reviews per optimizer step over all ranks.
    #[arg(long, default_value_t = 32)]
    global_batch: usize,
    /// Passes over the training reviews.
    #[arg(long, default_value_t = 4)]
    epochs: usize,
    /// Learning rate (Adam).
    #[arg(long, default_value_t = 1e-2)]
    lr: f64,
    /// Forward precision: no, fp16 or bf16 (default: ACCELERATE_MIXED_PRECISION, else no).
    #[arg(long)]
    mixed_precision: Option<MixedPrecision>,
    /// A data file of `label<TAB>text` lines after a header (default: `examples/data/reviews.tsv`).
    #[arg(long)]
    data: Option<PathBuf>,
    /// Loader worker threads reading and tokenising reviews ahead of the training loop.
    #[arg(long, default_value_t = 2)]
    workers: usize,
}

/// Lower-case words and punctuation marks.
fn tokenize(text: &str) -> Vec<String> {
    text.to_lowercase()
        .split(|c: char| c.is_whitespace() || c == ',' || c == '.')
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// Word ids, learned from the training reviews (0 pads, 1 is an unknown word), in a fixed order.
struct Vocabulary(BTreeMap<String, i64>);

impl Vocabulary {
    fn new<'a>(texts: impl Iterator<Item = &'a str>) -> Self {
        let words: std::collections::BTreeSet<String> = texts.flat_map(tokenize).collect();
        Self(words.into_iter().zip(2..).collect())
    }

    fn encode(&self, text: &str) -> Vec<i64> {
        tokenize(text)
            .iter()
            .map(|w| self.0.get(w).copied().unwrap_or(UNKNOWN))
            .collect()
    }

    fn decode(&self, ids: &[i64]) -> String {
        let words: BTreeMap<i64, &str> = self.0.iter().map(|(w, &i)| (i, w.as_str())).collect();
        ids.iter()
            .filter(|&&i| i != PAD)
            .map(|i| words.get(i).copied().unwrap_or("<unk>"))
            .collect::<Vec<_>>()
            .join(" ")
    }

    fn len(&self) -> usize {
        self.0.len() + 2
    }
}

#[derive(Clone, Debug)]
struct Review {
    ids: Vec<i64>,
    label: i64,
}

/// Token ids padded to the batch's longest review, the mask of real tokens, and the labels.
#[derive(Clone, Debug)]
struct Batch {
    ids: Tensor<2, Int>,
    mask: Tensor<2>,
    labels: Tensor<1, Int>,
}
impl_to_device!(Batch { ids, mask, labels });

#[derive(Clone)]
struct DynamicPadding;

impl Batcher<Review, Batch> for DynamicPadding {
    fn batch(&self, items: Vec<Review>, device: &Device) -> Batch {
        let (n, width) = (
            items.len(),
            items.iter().map(|r| r.ids.len()).max().unwrap_or(1),
        );
        let mut ids = vec![PAD; n * width];
        let mut mask = vec![0f32; n * width];
        for (row, review) in items.iter().enumerate() {
            for (col, &id) in review.ids.iter().enumerate() {
                ids[row * width + col] = id;
                mask[row * width + col] = 1.0;
            }
        }
        let labels: Vec<i64> = items.iter().map(|r| r.label).collect();
        Batch {
            ids: Tensor::<1, Int>::from_data(ids.as_slice(), device).reshape([n, width]),
            mask: Tensor::<1>::from_floats(mask.as_slice(), device).reshape([n, width]),
            labels: Tensor::from_data(labels.as_slice(), device),
        }
    }
}

#[derive(Module, Debug)]
struct SentimentModel {
    embedding: Embedding,
    hidden: Linear,
    out: Linear,
    act: Relu,
}

impl SentimentModel {
    fn new(vocabulary: usize, device: &Device) -> Self {
        Self {
            embedding: EmbeddingConfig::new(vocabulary, 32).init(device),
            hidden: LinearConfig::new(32, 32).init(device),
            out: LinearConfig::new(32, 2).init(device),
            act: Relu::new(),
        }
    }

    /// Logits from the mean of the real tokens' embeddings (padding contributes nothing).
    fn forward(&self, ids: Tensor<2, Int>, mask: Tensor<2>) -> Tensor<2> {
        let [n, width] = ids.dims();
        let mask = mask.reshape([n, width, 1]);
        let summed = (self.embedding.forward(ids) * mask.clone()).sum_dim(1);
        let pooled = (summed / mask.sum_dim(1)).reshape([n, 32]);
        self.out
            .forward(self.act.forward(self.hidden.forward(pooled)))
    }

    /// Cross-entropy of every review.
    fn losses(&self, batch: &Batch) -> Tensor<1> {
        let n = batch.labels.dims()[0];
        log_softmax(self.forward(batch.ids.clone(), batch.mask.clone()), 1)
            .gather(1, batch.labels.clone().reshape([n, 1]))
            .reshape([n])
            .neg()
    }
}

/// What evaluation found: accuracy and mean loss over every held-out review, and one misread review.
struct Evaluation {
    accuracy: f64,
    loss: f64,
    misread: Option<String>,
}

fn evaluate(
    acc: &Accelerator,
    model: &SentimentModel,
    eval: &PreparedDataLoader<Review, Batch>,
    vocabulary: &Vocabulary,
) -> Result<Evaluation> {
    let model = model.valid();
    let (mut correct, mut count, mut loss_sum, mut misread) = (0usize, 0usize, 0.0f64, None);
    for batch in eval.iter() {
        let batch = batch?;
        let batch = Batch {
            ids: batch.ids.inner(),
            mask: batch.mask.inner(),
            labels: batch.labels.inner(),
        };
        let losses = model.losses(&batch);
        let predictions = model
            .forward(batch.ids.clone(), batch.mask.clone())
            .argmax(1)
            .reshape([-1]);
        // Ranks padded their batches to different widths: make them equal before gathering.
        let ids = acc.pad_across_processes(batch.ids, 1, PAD as f64, false)?;
        let (predictions, labels, losses, ids) =
            acc.gather_for_metrics((predictions, batch.labels, losses, ids))?;
        let hits = predictions.clone().equal(labels.clone());
        count += labels.dims()[0];
        correct += hits.clone().int().sum().into_scalar::<i64>() as usize;
        loss_sum += losses.sum().into_scalar::<f32>() as f64;
        if misread.is_none() {
            // Read as integers: backends store booleans differently (bytes, or 32-bit words on wgpu).
            let hits: Vec<i64> = hits
                .int()
                .into_data()
                .convert::<i64>()
                .try_to_vec::<i64>()
                .map_err(|e| Error::InvalidArgument(format!("reading predictions back: {e:?}")))?;
            if let Some(row) = hits.iter().position(|&hit| hit == 0) {
                let width = ids.dims()[1];
                let row_ids = ids.narrow(0, row, 1).reshape([width]);
                let row_ids: Vec<i64> = row_ids
                    .into_data()
                    .convert::<i64>()
                    .try_to_vec::<i64>()
                    .map_err(|e| {
                        Error::InvalidArgument(format!("reading token ids back: {e:?}"))
                    })?;
                misread = Some(vocabulary.decode(&row_ids));
            }
        }
    }
    Ok(Evaluation {
        accuracy: correct as f64 / count.max(1) as f64,
        loss: loss_sum / count.max(1) as f64,
        misread,
    })
}

/// The reviews of `examples/data/reviews.tsv`, built in: read when the repository's file is not there.
const REVIEWS: &str = include_str!("data/reviews.tsv");

/// Labelled texts: `(label, text)`.
type Rows = Vec<(i64, String)>;

/// Where the reviews are read from.
enum Source {
    File(PathBuf),
    BuiltIn,
}

impl Source {
    /// The `len` bytes at `offset`: read from the file (opened anew: any number of workers read at once).
    fn read(&self, offset: usize, len: usize) -> std::io::Result<String> {
        match self {
            Source::File(path) => {
                let mut file = std::fs::File::open(path)?;
                file.seek(SeekFrom::Start(offset as u64))?;
                let mut bytes = vec![0; len];
                file.read_exact(&mut bytes)?;
                String::from_utf8(bytes).map_err(std::io::Error::other)
            }
            Source::BuiltIn => REVIEWS
                .get(offset..offset + len)
                .map(str::to_string)
                .ok_or_else(|| std::io::Error::other("outside the built-in reviews")),
        }
    }
}

/// One split of the data file as a Burn dataset: each review is read from the file and tokenised when a batch
/// needs it (on the loader's workers), from an index of line offsets.
#[derive(Clone)]
struct ReviewFile {
    source: Arc<Source>,
    lines: Arc<Vec<(usize, usize)>>,
    vocabulary: Arc<Vocabulary>,
}

impl Dataset<Review> for ReviewFile {
    fn get(&self, index: usize) -> std::result::Result<Review, DatasetError> {
        let &(offset, len) = self.lines.get(index).ok_or_else(|| {
            DatasetError::new(std::io::Error::other(format!("no review {index}")))
        })?;
        let line = self.source.read(offset, len).map_err(DatasetError::new)?;
        let (label, text) = parse(&line).ok_or_else(|| {
            DatasetError::new(std::io::Error::other(format!("malformed review: {line}")))
        })?;
        Ok(Review {
            ids: self.vocabulary.encode(text),
            label,
        })
    }

    fn len(&self) -> usize {
        self.lines.len()
    }
}

/// `label<TAB>text`.
fn parse(line: &str) -> Option<(i64, &str)> {
    let (label, text) = line.split_once('\t')?;
    Some((label.parse().ok()?, text))
}

/// The data file, read once to check every line and learn the vocabulary.
struct DataFile {
    /// The training reviews.
    train: Rows,
    /// Where the reviews are read from.
    source: Source,
    /// The byte offset and length of each review's line, training reviews first.
    lines: Vec<(usize, usize)>,
}

/// Reads the data file (`--data`, else the repository's, else the built-in copy).
fn read_reviews(args: &Args) -> Result<DataFile> {
    let repository = PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/data/reviews.tsv"
    ));
    let path = args
        .data
        .clone()
        .or_else(|| repository.exists().then_some(repository));
    let (text, name, source) = match path {
        Some(path) => (
            std::fs::read_to_string(&path).map_err(|source| Error::Io {
                operation: "reading",
                path: path.clone(),
                source,
            })?,
            path.display().to_string(),
            Source::File(path),
        ),
        None => (
            REVIEWS.to_string(),
            "reviews.tsv".to_string(),
            Source::BuiltIn,
        ),
    };
    let mut rows = Vec::new();
    let mut lines = Vec::new();
    let mut offset = 0;
    for (number, line) in text.split_inclusive('\n').enumerate() {
        let start = offset;
        offset += line.len();
        let line = line.trim_end_matches(['\n', '\r']);
        if number == 0 {
            continue;
        }
        let (label, review) = line.split_once('\t').ok_or_else(|| {
            Error::InvalidArgument(format!("{name}:{}: expected `label<TAB>text`", number + 1))
        })?;
        let label = label
            .parse::<i64>()
            .map_err(|e| Error::InvalidArgument(format!("{name}:{}: label: {e}", number + 1)))?;
        rows.push((label, review.to_string()));
        lines.push((start, line.len()));
    }
    if rows.len() <= TRAIN {
        return Err(Error::InvalidArgument(format!(
            "{name} holds {} reviews; the example needs more than {TRAIN}",
            rows.len()
        )));
    }
    rows.truncate(TRAIN);
    Ok(DataFile {
        train: rows,
        source,
        lines,
    })
}

fn train(
    acc: Accelerator,
    args: &Args,
    initial: SentimentModel,
    vocabulary: &Vocabulary,
    data: &(ReviewFile, ReviewFile),
) -> Result<Evaluation> {
    let p = acc.num_processes();
    if !args.global_batch.is_multiple_of(p) || !TRAIN.is_multiple_of(args.global_batch) {
        return Err(Error::InvalidArgument(format!(
            "--global-batch {} must divide {TRAIN} training reviews and be divisible by {p} ranks",
            args.global_batch
        )));
    }
    let batch = args.global_batch / p;
    let mut model = acc.prepare_model(initial)?;
    let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), args.lr);
    let train = acc.prepare_dataloader(
        DataLoaderBuilder::new(DynamicPadding)
            .batch_size(batch)
            .shuffle(11)
            .num_workers(args.workers)
            .build(data.0.clone()),
    )?;
    let eval = acc.prepare_dataloader(
        DataLoaderBuilder::new(DynamicPadding)
            .batch_size(batch)
            .num_workers(args.workers)
            .build(data.1.clone()),
    )?;
    for epoch in 0..args.epochs {
        let bar = acc.progress_bar(TRAIN as u64, "reviews");
        bar.set_message(format!("epoch {epoch}"));
        for batch in train.iter() {
            let loss = acc.autocast(&model, batch?, |model, batch| model.losses(&batch).mean());
            acc.backward(loss, &model)?;
            model = optimizer.step(model);
            bar.inc(args.global_batch as u64);
        }
        bar.finish_and_clear();
        let evaluation = evaluate(&acc, &model, &eval, vocabulary)?;
        acc.print(format!(
            "epoch={epoch} eval_accuracy={:.4} eval_loss={:.5}",
            evaluation.accuracy, evaluation.loss
        ));
    }
    // Every rank, not only the one that prints, ends with the same model.
    ranks::check_ranks_agree(&acc, &model)?;
    evaluate(&acc, &model, &eval, vocabulary)
}

fn main() {
    ranks::exit_on_error(run());
}

fn run() -> Result<()> {
    burn_accelerate::logging::init(None);
    let args = Args::parse();
    let DataFile {
        train: train_rows,
        source,
        mut lines,
    } = read_reviews(&args)?;
    let vocabulary = Arc::new(Vocabulary::new(train_rows.iter().map(|(_, t)| t.as_str())));
    let (source, eval_lines) = (Arc::new(source), lines.split_off(TRAIN));
    let split = |lines: Vec<(usize, usize)>| ReviewFile {
        source: source.clone(),
        lines: Arc::new(lines),
        vocabulary: vocabulary.clone(),
    };
    let data = (split(lines), split(eval_lines));
    // The same initial weights for any number of ranks.
    let device = ranks::default_device();
    device.seed(3);
    let initial = SentimentModel::new(vocabulary.len(), &device);

    let mut builder = Accelerator::builder();
    if let Some(precision) = args.mixed_precision {
        builder = builder.mixed_precision(precision);
    }
    let result = ranks::run_ranks(builder, args.processes, |acc| {
        train(acc, &args, initial.clone(), &vocabulary, &data)
    })?;
    if let Some(evaluation) = result {
        if let Some(review) = evaluation.misread {
            println!("misread: {review}");
        }
        println!("accuracy={:.4}", evaluation.accuracy);
        println!("final_loss={:.5}", evaluation.loss);
    }
    Ok(())
}
