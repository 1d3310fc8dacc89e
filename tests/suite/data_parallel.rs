//! Data-parallel training on in-process ranks: the same model as one rank with the combined batch, gradient
//! accumulation that communicates only on sync steps, and `gather_for_metrics` that sees every sample once.

use crate::examples;
use crate::fixtures;
use crate::mlp;
use crate::ranks;

use std::collections::BTreeMap;

use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::{AdamConfig, GradientsParams};
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::data::DataLoaderBuilder;
use burn_accelerate::{Accelerator, AcceleratorBuilder};
use fixtures::{initial, launch_counting, max_abs_diff};
use mlp::{Mlp, SampleBatcher, weights};

/// Trains the quicktour MLP from `start` on `samples` items for `epochs`; returns the final weights of rank 0.
fn train(
    start: &Mlp,
    builder: AcceleratorBuilder,
    ranks: usize,
    batch_size: usize,
    samples: usize,
    epochs: usize,
) -> Vec<Vec<f32>> {
    let out = builder
        .launch(ranks, |acc| {
            let mut model = acc.prepare_model(start.clone())?;
            let mut optimizer = acc.prepare_optimizer(AdamConfig::new().init(), 5e-3);
            let loader = acc.prepare_dataloader(
                DataLoaderBuilder::new(SampleBatcher)
                    .batch_size(batch_size)
                    .shuffle(7)
                    .build(mlp::dataset(samples, 11)),
            )?;
            for _ in 0..epochs {
                for batch in loader.iter() {
                    acc.accumulate();
                    let loss = model.loss(batch?);
                    acc.backward(loss, &model)?;
                    model = optimizer.step(model);
                }
            }
            Ok(weights(&model))
        })
        .unwrap();
    for other in &out[1..] {
        assert_eq!(
            max_abs_diff(&out[0], other),
            0.0,
            "ranks must hold identical weights"
        );
    }
    out.into_iter().next().unwrap()
}

#[test]
fn prepare_model_gives_every_rank_the_weights_of_rank_0() {
    let per_rank = Accelerator::builder()
        .launch(3, |acc| {
            // Different weights on every rank before preparation.
            let model = Mlp::new(acc.device());
            let own = weights(&model);
            let prepared = weights(&acc.prepare_model(model)?);
            Ok((own, prepared))
        })
        .unwrap();
    let root = &per_rank[0].0;
    assert!(
        max_abs_diff(root, &per_rank[1].0) > 0.0,
        "ranks started apart"
    );
    for (_, prepared) in &per_rank {
        assert_eq!(max_abs_diff(root, prepared), 0.0);
    }
}

#[test]
fn p_ranks_match_one_rank_with_the_combined_batch() {
    let start = initial();
    let (b, samples, epochs) = (4, 96, 2);
    for p in [2, 4] {
        let reference = train(&start, Accelerator::builder(), 1, p * b, samples, epochs);
        let ranks = train(&start, Accelerator::builder(), p, b, samples, epochs);
        let diff = max_abs_diff(&reference, &ranks);
        assert!(diff <= 1e-5, "P={p}: max |w_P - w_1| = {diff}");

        let split = train(
            &start,
            Accelerator::builder().split_batches(true),
            p,
            p * b,
            samples,
            epochs,
        );
        let diff = max_abs_diff(&reference, &split);
        assert!(diff <= 1e-5, "P={p} split_batches: {diff}");
    }
}

#[test]
fn accumulation_on_p_ranks_matches_one_big_batch() {
    let start = initial();
    let (b, n, samples) = (4, 3, 96);
    for p in [2, 4] {
        let reference = train(&start, Accelerator::builder(), 1, p * b * n, samples, 2);
        let accumulated = train(
            &start,
            Accelerator::builder().gradient_accumulation_steps(n),
            p,
            b,
            samples,
            2,
        );
        let diff = max_abs_diff(&reference, &accumulated);
        assert!(diff <= 1e-5, "P={p} N={n}: {diff}");
    }
}

#[test]
fn gradients_on_sync_equal_the_full_batch_gradients_and_only_sync_steps_communicate() {
    let (p, b, n) = (2, 3, 2);
    let samples = mlp::samples(p * b * n * 2, 5);
    let device = Device::default().autodiff();
    device.seed(3);
    let initial = Mlp::new(&device);
    let init = initial.clone();
    let data = samples.clone();
    let per_rank = launch_counting(
        Accelerator::builder().gradient_accumulation_steps(n),
        p,
        move |acc, all_reduces| {
            let model = acc.prepare_model(init.clone())?;
            let loader = acc.prepare_dataloader(
                DataLoaderBuilder::new(SampleBatcher)
                    .batch_size(b)
                    .build(InMemDataset::new(data.clone())),
            )?;
            let mut log = Vec::new();
            for batch in loader.iter() {
                let before = all_reduces();
                let sync = acc.accumulate();
                acc.backward(model.loss(batch?), &model)?;
                let communicated = all_reduces() - before;
                let grad = acc
                    .grad(&model_weight(&model))
                    .map(|g| g.into_data().try_to_vec::<f32>().unwrap());
                log.push((sync, communicated, grad));
                if sync {
                    acc.process_group(); // the optimizer would step here; drop the gradients instead
                    acc.zero_grad();
                }
            }
            Ok(log)
        },
    )
    .unwrap();
    assert_eq!(per_rank.len(), p);
    for (rank, log) in per_rank.iter().enumerate() {
        assert_eq!(
            log.iter().map(|(s, _, _)| *s).collect::<Vec<_>>(),
            vec![false, true, false, true],
            "rank {rank}"
        );
        for (sync, communicated, _) in log {
            assert_eq!(
                *communicated > 0,
                *sync,
                "rank {rank}: all-reduce only on sync steps ({communicated} calls)"
            );
        }
    }
    // Reference: the gradient of the first layer's weight over each window of p*b*n samples at once, which
    // every rank must hold after each sync.
    let window = p * b * n;
    let synced = per_rank.iter().enumerate().flat_map(|(rank, log)| {
        log.iter()
            .filter(|(s, _, _)| *s)
            .enumerate()
            .map(move |e| (rank, e))
    });
    for (rank, (w, (_, _, grad))) in synced {
        let model = initial.clone();
        let batch = SampleBatcher.batch(samples[w * window..(w + 1) * window].to_vec(), &device);
        let grads = GradientsParams::from_grads(model.loss(batch).backward(), &model);
        let expected = grads
            .get::<2>(model_weight(&model).id)
            .unwrap()
            .into_data()
            .try_to_vec::<f32>()
            .unwrap();
        let got = grad.as_ref().unwrap();
        assert_eq!(expected.len(), got.len(), "rank {rank}, window {w}");
        // A NaN on either side is infinitely different (f32::max would skip it).
        let diff = expected
            .iter()
            .zip(got)
            .map(|(a, b)| (a - b).abs())
            .fold(
                0.0,
                |m: f32, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            );
        assert!(diff <= 1e-6, "rank {rank}, window {w}: {diff}");
    }
}

fn model_weight(model: &Mlp) -> Param<Tensor<2>> {
    struct First(Option<Param<Tensor<2>>>);
    impl ModuleVisitor for First {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.0.is_none() && D == 2 {
                let t: Tensor<2> = param.val().reshape(param.val().shape());
                self.0 = Some(Param::initialized(param.id, t));
            }
        }
    }
    let mut f = First(None);
    model.visit(&mut f);
    f.0.unwrap()
}

/// The ids of an index tensor, on the host (as i64 whatever the backend stores).
fn host_ids(ids: Tensor<1, Int>) -> Vec<i64> {
    ids.into_data().convert::<i64>().try_into_vec().unwrap()
}

/// Items are their own index; the batch is the index tensor.
#[derive(Clone)]
struct Ids;
impl Batcher<i64, Tensor<1, Int>> for Ids {
    fn batch(&self, items: Vec<i64>, device: &Device) -> Tensor<1, Int> {
        Tensor::from_data(items.as_slice(), device)
    }
}

#[test]
fn gather_for_metrics_sees_every_sample_once() {
    for n in [82usize, 99, 512] {
        for bs in 1..=8usize {
            for p in [2usize, 3, 4] {
                for (split, shuffle) in [(false, false), (false, true), (true, true)] {
                    if split && bs % p != 0 {
                        continue;
                    }
                    let per_rank = Accelerator::builder()
                        .split_batches(split)
                        .launch(p, |acc| {
                            let mut builder = DataLoaderBuilder::new(Ids).batch_size(bs);
                            if shuffle {
                                builder = builder.shuffle(1);
                            }
                            let loader = acc.prepare_dataloader(
                                builder.build(InMemDataset::new((0..n as i64).collect())),
                            )?;
                            let mut seen = Vec::new();
                            let mut objects = Vec::new();
                            for batch in loader.iter() {
                                let batch = batch?;
                                let ids = host_ids(batch.clone());
                                seen.extend(host_ids(acc.gather_for_metrics(batch)?));
                                objects.extend(acc.gather_for_metrics_objects(&ids)?);
                            }
                            Ok((seen, objects))
                        })
                        .unwrap();
                    for (seen, objects) in per_rank {
                        assert_eq!(seen, objects, "tensors and objects agree");
                        assert_eq!(seen.len(), n, "n={n} bs={bs} P={p} split={split}: count");
                        let counts = seen.iter().fold(BTreeMap::new(), |mut m, x| {
                            *m.entry(*x).or_insert(0) += 1;
                            m
                        });
                        assert!(
                            counts.len() == n && counts.values().all(|c| *c == 1),
                            "n={n} bs={bs} P={p} split={split}: every sample exactly once"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn drop_last_gathers_only_full_rounds() {
    let per_rank = Accelerator::builder()
        .launch(2, |acc| {
            let loader = acc.prepare_dataloader(
                DataLoaderBuilder::new(Ids)
                    .batch_size(3)
                    .drop_last(true)
                    .build(InMemDataset::new((0..22).collect())),
            )?;
            let mut seen = 0;
            for batch in loader.iter() {
                seen += acc.gather_for_metrics(batch?)?.dims()[0];
            }
            Ok(seen)
        })
        .unwrap();
    assert_eq!(per_rank, vec![18, 18]);
}

#[test]
fn split_batches_rejects_an_indivisible_batch_size() {
    let errors = Accelerator::builder()
        .split_batches(true)
        .launch(3, |acc| {
            let loader = DataLoaderBuilder::new(Ids)
                .batch_size(4)
                .build(InMemDataset::new(vec![0i64; 8]));
            Ok(acc.prepare_dataloader(loader).err().map(|e| e.to_string()))
        })
        .unwrap();
    assert_eq!(errors.len(), 3);
    for (rank, error) in errors.iter().enumerate() {
        let error = error
            .as_ref()
            .unwrap_or_else(|| panic!("rank {rank}: no error"));
        assert!(error.contains("round multiple"), "rank {rank}: {error}");
    }
}

#[test]
fn a_short_last_window_is_normalised_by_its_real_length() {
    let start = initial();
    // 7 micro-batches of 4 with accumulation 3: windows of 3, 3 and 1 micro-batches, the last one ended by the
    // end of the dataloader. The reference takes batches of 12, 12 and 4.
    let reference = train(&start, Accelerator::builder(), 1, 12, 28, 1);
    let actual = train(
        &start,
        Accelerator::builder().gradient_accumulation_steps(3),
        1,
        4,
        28,
        1,
    );
    assert!(max_abs_diff(&reference, &actual) <= 1e-6);
    let nominal = train(
        &start,
        Accelerator::builder()
            .gradient_accumulation_steps(3)
            .loss_normalization(burn_accelerate::config::LossNormalization::Nominal),
        1,
        4,
        28,
        1,
    );
    assert!(
        max_abs_diff(&reference, &nominal) > 1e-4,
        "Accelerate's nominal division under-weights the short window"
    );
}

/// Runs a built example of this package and returns its `final_loss=` and `accuracy=` lines.
fn example_result(name: &str, args: &[&str]) -> Vec<String> {
    let out = std::process::Command::new(examples::example(name))
        .args(args)
        .output()
        .expect("the example runs");
    examples::result_lines(out, &["final_loss=", "accuracy="])
}

#[test]
fn data_parallel_example_gives_the_same_result_on_1_and_2_ranks() {
    let one = example_result("data_parallel", &["--processes", "1"]);
    assert_eq!(one.len(), 2, "{one:?}");
    assert_eq!(example_result("data_parallel", &["--processes", "2"]), one);
}

/// Each batch as its item indices, on the host.
struct HostIds;
impl Batcher<usize, Vec<usize>> for HostIds {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

#[test]
fn loader_workers_deal_every_rank_the_batches_of_the_loop() {
    for ranks in [1, 3] {
        // Two epochs of every rank's batches, with 0, 1 and 4 workers.
        let dealt: Vec<Vec<Vec<Vec<usize>>>> = [0, 1, 4]
            .into_iter()
            .map(|workers| {
                Accelerator::builder()
                    .launch(ranks, |acc| {
                        let builder = DataLoaderBuilder::new(HostIds).batch_size(5).shuffle(9);
                        let builder = if workers > 0 {
                            builder.num_workers(workers)
                        } else {
                            builder
                        };
                        let loader = acc.prepare_dataloader(
                            builder.build(InMemDataset::new((0..103).collect())),
                        )?;
                        let mut batches = Vec::new();
                        for _ in 0..2 {
                            for batch in loader.iter() {
                                batches.push(batch?);
                            }
                        }
                        Ok(batches)
                    })
                    .unwrap()
            })
            .collect();
        assert_eq!(dealt[1], dealt[0], "{ranks} ranks, 1 worker");
        assert_eq!(dealt[2], dealt[0], "{ranks} ranks, 4 workers");
        // Every item is dealt in each epoch (the last round is completed by cycling, `even_batches`).
        let mut first_epoch: Vec<usize> = dealt[2]
            .iter()
            .flat_map(|rank| rank[..rank.len() / 2].concat())
            .collect();
        first_epoch.sort();
        first_epoch.dedup();
        assert_eq!(first_epoch, (0..103).collect::<Vec<_>>(), "{ranks} ranks");
    }
}

/// One rank's epoch of a prepared stream of `0..n` (an `Err` instead of item `fail_at`): every batch gathered
/// for metrics, whether each batch ended the dataloader, and whether it ended an accumulation window.
type StreamEpoch = (Vec<i64>, Vec<bool>, Vec<bool>, Option<String>);

fn stream_epoch(
    acc: &Accelerator,
    n: i64,
    batch_size: usize,
    drop_last: bool,
    fail_at: Option<i64>,
) -> burn_accelerate::Result<StreamEpoch> {
    let opened = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    stream_epoch_with(acc, (n, batch_size, drop_last, fail_at), false, &opened)
}

/// [`stream_epoch`], with `dispatch_batches`, counting the ranks that opened the stream in `opened`.
fn stream_epoch_with(
    acc: &Accelerator,
    (n, batch_size, drop_last, fail_at): (i64, usize, bool, Option<i64>),
    dispatch: bool,
    opened: &std::sync::Arc<std::sync::atomic::AtomicUsize>,
) -> burn_accelerate::Result<StreamEpoch> {
    let opened = opened.clone();
    let stream = burn_accelerate::data::StreamLoader::new(Ids, batch_size, drop_last, move || {
        opened.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        (0..n).map(move |i| {
            if Some(i) == fail_at {
                Err(burn_accelerate::Error::other(format!(
                    "line {i} is unreadable"
                )))
            } else {
                Ok(i)
            }
        })
    })
    .dispatch_batches(dispatch);
    let prepared = acc.prepare_stream(stream)?;
    let (mut seen, mut ends, mut syncs, mut error) = (Vec::new(), Vec::new(), Vec::new(), None);
    for batch in prepared.iter() {
        let batch = match batch {
            Ok(batch) => batch,
            Err(e) => {
                error = Some(e.to_string());
                continue;
            }
        };
        syncs.push(acc.accumulate());
        ends.push(acc.gradient_state().end_of_dataloader);
        seen.extend(host_ids(acc.gather_for_metrics(batch)?));
    }
    Ok((seen, ends, syncs, error))
}

#[test]
fn a_stream_is_dealt_between_ranks_and_gathered_back_whole() {
    for ranks in [1, 2, 3] {
        for (n, batch_size, drop_last) in [
            (103, 5, false),
            (103, 5, true),
            (7, 4, false),
            (30, 5, false),
        ] {
            let case =
                format!("{ranks} ranks, {n} items, batch {batch_size}, drop_last {drop_last}");
            let epochs = Accelerator::builder()
                .gradient_accumulation_steps(4)
                .launch(ranks, |acc| {
                    stream_epoch(&acc, n, batch_size, drop_last, None)
                })
                .unwrap();
            let chunk = (batch_size * ranks) as i64;
            let kept = if drop_last { n / chunk * chunk } else { n };
            let batches = if drop_last {
                n / chunk
            } else {
                (n + chunk - 1) / chunk
            } as usize;
            for (rank, (seen, ends, syncs, error)) in epochs.iter().enumerate() {
                assert_eq!(error, &None, "{case}");
                assert_eq!(
                    seen,
                    &(0..kept).collect::<Vec<_>>(),
                    "{case}, rank {rank}: gathered"
                );
                assert_eq!(ends.len(), batches, "{case}, rank {rank}: batches");
                let mut expected_ends = vec![false; batches];
                if let Some(last) = expected_ends.last_mut() {
                    *last = true;
                }
                assert_eq!(
                    ends, &expected_ends,
                    "{case}, rank {rank}: end of dataloader"
                );
                assert_eq!(
                    syncs.last(),
                    Some(&true),
                    "{case}: the last batch ends the window"
                );
                let windows: Vec<bool> =
                    (1..=batches).map(|i| i % 4 == 0 || i == batches).collect();
                assert_eq!(syncs, &windows, "{case}, rank {rank}: accumulation windows");
            }
        }
    }
}

/// `split_batches`: the stream's batch size is the global batch, split between the ranks, so every number of
/// ranks takes the same batches (the one-rank run's), each rank a slice; a global batch the ranks cannot split
/// is refused with both numbers.
#[test]
fn a_stream_with_split_batches_deals_the_global_batch() {
    for ranks in [1, 2, 3] {
        for (n, global, drop_last) in [(103, 6, false), (103, 6, true), (5, 6, false)] {
            let case =
                format!("{ranks} ranks, {n} items, global batch {global}, drop_last {drop_last}");
            let epochs = Accelerator::builder()
                .split_batches(true)
                .launch(ranks, |acc| stream_epoch(&acc, n, global, drop_last, None))
                .unwrap();
            let kept = if drop_last {
                n / global as i64 * global as i64
            } else {
                n
            };
            let batches = if drop_last {
                n as usize / global
            } else {
                (n as usize).div_ceil(global)
            };
            for (rank, (seen, ends, _, error)) in epochs.iter().enumerate() {
                assert_eq!(error, &None, "{case}");
                assert_eq!(
                    seen,
                    &(0..kept).collect::<Vec<_>>(),
                    "{case}, rank {rank}: gathered"
                );
                assert_eq!(
                    ends.len(),
                    batches,
                    "{case}, rank {rank}: one batch per global batch"
                );
            }
        }
    }
    let refused = Accelerator::builder()
        .split_batches(true)
        .launch(4, |acc| stream_epoch(&acc, 20, 6, false, None))
        .expect_err("6 cannot be split between 4 ranks");
    let message = refused.to_string();
    assert!(message.contains('6') && message.contains('4'), "{message}");
}

#[test]
fn a_stream_error_reaches_every_rank_at_the_same_batch() {
    let epochs = Accelerator::builder()
        .launch(3, |acc| stream_epoch(&acc, 100, 4, false, Some(50)))
        .unwrap();
    for (seen, ends, _, error) in &epochs {
        // Chunks of 12 items: four complete (48 items), then the error while reading the fifth.
        assert_eq!(seen, &(0..48).collect::<Vec<_>>());
        assert_eq!(ends, &vec![false; 4]);
        let error = error.as_deref().expect("the stream's error");
        assert!(error.contains("line 50 is unreadable"), "{error}");
    }
}

#[test]
fn dispatched_streams_are_read_by_the_main_process_alone_and_deal_the_same_batches() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    for ranks in [2, 3] {
        for case in [
            (103, 5, false, None),
            (103, 5, true, None),
            (7, 4, false, None),
            (100, 4, false, Some(50)),
        ] {
            let read_by_all = Arc::new(AtomicUsize::new(0));
            let read_by_main = Arc::new(AtomicUsize::new(0));
            let each = Accelerator::builder()
                .launch(ranks, |acc| {
                    stream_epoch_with(&acc, case, false, &read_by_all)
                })
                .unwrap();
            let dispatched = Accelerator::builder()
                .launch(ranks, |acc| {
                    stream_epoch_with(&acc, case, true, &read_by_main)
                })
                .unwrap();
            let error = |e: &StreamEpoch| e.3.as_ref().map(|m| m.contains("line 50 is unreadable"));
            // The failing case fails on every rank, both ways, with the reader's message; the others do not.
            let expected = case.3.map(|_| true);
            assert_eq!(each.len(), ranks);
            assert_eq!(dispatched.len(), ranks);
            for (rank, (a, b)) in each.iter().zip(&dispatched).enumerate() {
                let label = format!("{ranks} ranks, case {case:?}, rank {rank}");
                assert_eq!((&a.0, &a.1, &a.2), (&b.0, &b.1, &b.2), "{label}");
                assert_eq!(error(a), expected, "{label}: {:?}", a.3);
                assert_eq!(error(b), expected, "{label}: {:?}", b.3);
            }
            assert_eq!(
                read_by_all.load(Ordering::SeqCst),
                ranks,
                "every rank opened it"
            );
            assert_eq!(
                read_by_main.load(Ordering::SeqCst),
                1,
                "only the main process opened it"
            );
        }
    }
}

/// A stream saved mid-epoch by N ranks continues on M with the same global batch (12 items a round: 12 / N a rank),
/// read by every rank or dispatched from the main process: the resumed ranks gather exactly the items after the
/// save, in order, and the next epoch starts the stream from its beginning.
#[test]
fn a_stream_saved_mid_epoch_continues_on_another_number_of_ranks() {
    let dir = std::env::temp_dir().join(format!("ba-stream-resume-{}", std::process::id()));
    let stream = |acc: &Accelerator, dispatch: bool| {
        let per_rank = 12 / acc.num_processes();
        let loader =
            burn_accelerate::data::StreamLoader::new(Ids, per_rank, false, || (0..60i64).map(Ok))
                .dispatch_batches(dispatch);
        acc.prepare_stream(loader)
    };
    for dispatch in [false, true] {
        for (n, m) in [(2, 3), (3, 1), (1, 4), (4, 2), (2, 2)] {
            let what = format!("{n} -> {m} ranks, dispatch_batches {dispatch}");
            let _ = std::fs::remove_dir_all(&dir);
            // Two rounds of the first epoch (items 0..24), then the save.
            let before = Accelerator::builder()
                .launch(n, |acc| {
                    let prepared = stream(&acc, dispatch)?;
                    let mut seen = Vec::new();
                    for batch in prepared.iter().take(2) {
                        seen.extend(host_ids(acc.gather_for_metrics(batch?)?));
                    }
                    acc.save_state(Some(&dir), &burn_accelerate::StateToSave::new())?;
                    Ok(seen)
                })
                .unwrap();
            assert_eq!(before[0], (0..24).collect::<Vec<_>>(), "{what}");
            let after = Accelerator::builder()
                .launch(m, |acc| {
                    let prepared = stream(&acc, dispatch)?;
                    acc.load_state(Some(&dir))?.finish()?;
                    let mut epochs = Vec::new();
                    for _ in 0..2 {
                        let mut seen = Vec::new();
                        for batch in prepared.iter() {
                            seen.extend(host_ids(acc.gather_for_metrics(batch?)?));
                        }
                        epochs.push(seen);
                    }
                    Ok(epochs)
                })
                .unwrap();
            for (rank, epochs) in after.iter().enumerate() {
                assert_eq!(
                    epochs[0],
                    (24..60).collect::<Vec<_>>(),
                    "{what}, rank {rank}: the rest of the epoch"
                );
                assert_eq!(
                    epochs[1],
                    (0..60).collect::<Vec<_>>(),
                    "{what}, rank {rank}: the next epoch, whole"
                );
            }
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn the_examples_agreement_check_names_a_rank_whose_weights_differ() {
    /// Moves the first float parameter by a thousandth.
    struct Nudge(bool);
    impl burn::module::ModuleMapper for Nudge {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if std::mem::replace(&mut self.0, true) {
                return param;
            }
            param.map(|t| t.add_scalar(1e-3))
        }
    }
    let start = initial();
    let results = burn_accelerate::launch(3, |acc| {
        let model = acc.prepare_model(start.clone())?;
        let same = ranks::check_ranks_agree(&acc, &model).map_err(|e| e.to_string());
        let model = if acc.process_index() == 2 {
            model.map(&mut Nudge(false))
        } else {
            model
        };
        let differ = ranks::check_ranks_agree(&acc, &model).map_err(|e| e.to_string());
        Ok((same, differ))
    })
    .unwrap();
    assert_eq!(results.len(), 3);
    for (rank, (same, differ)) in results.iter().enumerate() {
        assert_eq!(same, &Ok(()), "rank {rank}");
        let err = differ.as_ref().expect_err("rank 2 moved a weight");
        assert!(
            err.contains("rank 2's weights differ"),
            "rank {rank}: {err}"
        );
    }
}
