//! Typed errors of burn-accelerate.
//!
//! Every error says what went wrong, where, and how to fix it, so that it can be shown to a user as is.

use std::path::{Path, PathBuf};

/// The result type of every fallible burn-accelerate call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in burn-accelerate.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A backend was asked for (builder, `BURN_DEVICE`, `ACCELERATE_USE_CPU`) that this build does not contain.
    #[error(
        "the `{backend}` backend was requested ({origin}) but is not compiled in; enable the cargo feature \
         `{feature}` of burn-accelerate (for example `cargo run --features {feature}`)"
    )]
    BackendNotCompiled {
        /// The backend that was requested.
        backend: String,
        /// Where the request came from.
        origin: String,
        /// The cargo feature that compiles it in.
        feature: &'static str,
    },

    /// This build has no compute backend at all.
    #[error(
        "no compute backend is compiled in; enable one cargo feature of burn-accelerate: {available}"
    )]
    NoBackend {
        /// The feature names that would provide one.
        available: &'static str,
    },

    /// A backend is compiled in but cannot run on this machine (no driver, no device); what its
    /// [probe](crate::backend::probe) found.
    #[error("the `{backend}` backend cannot run here ({origin}): {missing}; {fix}")]
    BackendUnavailable {
        /// The backend.
        backend: String,
        /// Why it was chosen (`requested explicitly`, `BURN_DEVICE`, `default`).
        origin: String,
        /// What is missing.
        missing: String,
        /// How to fix it.
        fix: String,
    },

    /// A configuration value (builder, environment variable or config file) is not valid.
    #[error("invalid value {value:?} for {key} ({origin}): {expected}")]
    InvalidConfig {
        /// The setting, e.g. `ACCELERATE_USE_CPU` or `gradient_accumulation_steps`.
        key: String,
        /// The value that was given.
        value: String,
        /// Where it came from (environment, builder, file path).
        origin: String,
        /// What would have been accepted.
        expected: String,
    },

    /// A gradient operation was asked for while no gradient is stored.
    #[error(
        "{operation}: no gradients are stored for this model; call `accelerator.backward(loss, &model)` first"
    )]
    NoGradients {
        /// The operation that needed gradients.
        operation: &'static str,
    },

    /// A tensor value could not be read back from the device.
    #[error("reading a tensor back from {device} failed during {operation}: {reason}")]
    Execution {
        /// What was being done.
        operation: &'static str,
        /// The device the tensor lives on.
        device: String,
        /// The backend's message.
        reason: String,
    },

    /// A dataset item could not be loaded.
    #[error("loading item {index} of the dataset failed: {reason}")]
    Dataset {
        /// The index of the item.
        index: usize,
        /// The dataset's message.
        reason: String,
    },

    /// A file could not be read or written.
    #[error("{operation} {path}: {source}")]
    Io {
        /// What was being done ("reading", "writing", ...).
        operation: &'static str,
        /// The file concerned.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// A collective failed: timeout, failed rank, mismatched calls or an engine error.
    #[error(transparent)]
    Comm(#[from] burn_accelerate_comm::CommError),

    /// Tensors given to a collective have shapes that cannot be combined (Accelerate's message).
    #[error(
        "Cannot apply desired operation due to shape mismatches. All shapes across devices must be valid.\n\n\
         Operation: `{operation}`\nInput shapes:\n  - {}",
        shapes.iter().enumerate().map(|(i, s)| format!("Process {i}: {s}")).collect::<Vec<_>>().join("\n  - ")
    )]
    ShapeMismatch {
        /// The collective.
        operation: String,
        /// Each rank's shape, in rank order, formatted like a Python list.
        shapes: Vec<String>,
    },

    /// The device cannot compute in the requested precision.
    #[error(
        "mixed_precision={precision} needs {dtype} arithmetic, which {device} does not support; use another \
         precision (bf16 and fp16 both run on the flex CPU backend; ndarray has neither; Vulkan drivers often lack \
         bf16) or another device"
    )]
    UnsupportedDtype {
        /// The device.
        device: String,
        /// The dtype it lacks.
        dtype: String,
        /// The precision asked for.
        precision: &'static str,
    },

    /// A checkpoint file is missing, truncated, corrupt, or does not fit the model.
    #[error("checkpoint {path}: {reason}")]
    Checkpoint {
        /// The file or folder.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// Another rank failed during an operation every rank takes part in (a save, a load), so this rank stops too,
    /// at once rather than after the collective timeout.
    #[error("{operation}: rank {rank} failed, so every rank stops: {message}")]
    OtherRankFailed {
        /// The operation (`save_state`, `save_model`, ...).
        operation: &'static str,
        /// The rank that failed (the lowest, when several did).
        rank: usize,
        /// Its error.
        message: String,
    },

    /// A rank of an in-process launch panicked.
    #[error("rank {rank} panicked: {message}")]
    RankPanicked {
        /// The rank.
        rank: usize,
        /// The panic message.
        message: String,
    },

    /// An experiment tracker failed, or a tracker's file could not be read back.
    #[error("tracker {tracker}: {reason}")]
    Tracker {
        /// The tracker's name (`"tensorboard"`, or a custom tracker's).
        tracker: String,
        /// What went wrong.
        reason: String,
    },

    /// Bad input to a call that is not covered by a more specific variant.
    #[error("{0}")]
    InvalidArgument(String),

    /// An error of the program's own, returned through the library: from a rank's closure in
    /// [`launch`](crate::launch), say. `?` converts a `Box<dyn std::error::Error + Send + Sync>`, a `String`
    /// or a `&str` into it; any other error type with [`Error::other`] (`.map_err(Error::other)?`).
    #[error("{0}")]
    Other(Box<dyn std::error::Error + Send + Sync>),
}

impl From<Box<dyn std::error::Error + Send + Sync>> for Error {
    fn from(error: Box<dyn std::error::Error + Send + Sync>) -> Self {
        Error::Other(error)
    }
}

impl From<String> for Error {
    fn from(message: String) -> Self {
        Error::Other(message.into())
    }
}

impl From<&str> for Error {
    fn from(message: &str) -> Self {
        Error::Other(message.into())
    }
}

impl Error {
    /// Wraps any error of the program's own (an I/O error, a parse error, an `anyhow::Error`...) as
    /// [`Error::Other`], whose message is that error's.
    ///
    /// ```
    /// use burn_accelerate::{Error, launch};
    ///
    /// let result = launch(2, |accelerator| {
    ///     let steps: usize = "ten".parse().map_err(Error::other)?; // a ParseIntError, as the rank's error
    ///     Ok(steps * accelerator.num_processes())
    /// });
    /// assert_eq!(result.unwrap_err().to_string(), "invalid digit found in string");
    /// ```
    pub fn other(error: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> Self {
        Error::Other(error.into())
    }

    /// Shorthand for [`Error::InvalidConfig`].
    pub(crate) fn config(
        key: impl Into<String>,
        value: impl Into<String>,
        origin: impl Into<String>,
        expected: impl Into<String>,
    ) -> Self {
        Self::InvalidConfig {
            key: key.into(),
            value: value.into(),
            origin: origin.into(),
            expected: expected.into(),
        }
    }
}

/// Wraps an operating-system error of `operation` ("reading", "writing", ...) on `path` as [`Error::Io`], for
/// `map_err`.
pub(crate) fn io(operation: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> Error {
    let path = path.to_path_buf();
    move |source| Error::Io {
        operation,
        path,
        source,
    }
}
