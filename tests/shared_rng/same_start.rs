//! A program that seeds, builds its model on every rank and prepares it (Burn draws parameters lazily, at their
//! first use) starts from the same weights on 1, 2 and 4 in-process ranks, every time: the ranks share the
//! device's random generator, and `prepare_model` draws on the main process alone, after every rank seeded.
//!
//! The test draws from the shared generator, so it shares its binary only with the generator's other tests, taking
//! turns with them.

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Embedding, EmbeddingConfig, Linear, LinearConfig};
use burn::tensor::{Device, Int, Tensor};
use burn_accelerate::launch;

/// A model whose parameters are all drawn lazily, visited in another order than the forward pass uses them
/// (so a 1-rank run that drew them at the first forward pass would draw them in another order).
#[derive(Module, Debug)]
struct Net {
    head: Linear,
    embedding: Embedding,
    body: Linear,
}

impl Net {
    fn new(device: &Device) -> Self {
        Self {
            head: LinearConfig::new(32, 4).init(device),
            embedding: EmbeddingConfig::new(50, 16).init(device),
            body: LinearConfig::new(16, 32).init(device),
        }
    }

    #[allow(dead_code)]
    fn forward(&self, ids: Tensor<2, Int>) -> Tensor<3> {
        self.head
            .forward(self.body.forward(self.embedding.forward(ids)))
    }
}

/// Every parameter's values, in visiting order.
fn weights<M: Module>(model: &M) -> Vec<Vec<f32>> {
    struct Collect(Vec<Vec<f32>>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0
                .push(param.val().into_data().try_to_vec::<f32>().unwrap());
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// The program: seed, build, prepare; every rank's starting weights.
fn start(ranks: usize) -> Vec<Vec<Vec<f32>>> {
    launch(ranks, |accelerator| {
        accelerator.set_seed(1234, false);
        let model = Net::new(accelerator.device());
        let model = accelerator.prepare_model(model)?;
        Ok(weights(&model))
    })
    .unwrap()
}

#[test]
fn fifty_starts_on_2_and_4_ranks_equal_the_1_rank_start() {
    let _turn = crate::exclusive_rng();
    let reference = start(1).pop().unwrap();
    assert_eq!(reference.len(), 5, "2 weights, 2 biases and 1 table");
    for repetition in 0..50 {
        for ranks in [2, 4] {
            for (rank, weights) in start(ranks).iter().enumerate() {
                assert!(
                    *weights == reference,
                    "repetition {repetition}, {ranks} ranks: rank {rank} starts elsewhere than 1 rank"
                );
            }
        }
    }
}
