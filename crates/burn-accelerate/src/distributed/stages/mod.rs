//! Pipeline parallelism's building blocks: how a model's blocks are cut into stages, the schedules that order each
//! stage's micro-batches, their timeline and its trace. The stage runtime (placing each stage's blocks on its
//! ranks, moving activations and their gradients between stages) is their first caller; until it lands, the tests
//! drive them.
#![cfg_attr(not(test), allow(dead_code))]

pub(crate) mod partition;
pub(crate) mod schedule;
