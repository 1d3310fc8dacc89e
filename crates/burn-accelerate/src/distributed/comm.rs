//! Communication between ranks: the [`Communicator`] trait and its embedded engines, from the
//! `burn-accelerate-comm` crate (where other engines, such as MPI, implement it too).

pub use burn_accelerate_comm::*;
