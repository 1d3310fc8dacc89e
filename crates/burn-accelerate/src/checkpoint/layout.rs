//! Tensor layouts and key remapping for weights shared with PyTorch and Hugging Face tools.
//!
//! Burn keeps a `Linear` weight as `[in, out]` and names normalisation parameters `gamma`/`beta`; PyTorch keeps
//! `[out, in]` and says `weight`/`bias`. [`WeightLayout::PyTorch`] converts with burn-store's
//! `BurnToPyTorchAdapter` on save and `PyTorchToBurnAdapter` on load (a Linear weight is transposed, a
//! `BatchNorm`/`LayerNorm`/`GroupNorm`/`RmsNorm` parameter renamed); convolutions, embeddings and everything
//! else have the same layout in both. [`KeyRemap`] renames keys with ordered regex rules (burn-store's
//! `KeyRemapper`), e.g. to strip the `model.` or `module.` prefix a training wrapper added.

use burn::store::bridge;
use burn::store::{
    BurnToPyTorchAdapter, KeyRemapper, ModuleAdapter, ModuleContext, PyTorchToBurnAdapter,
};
use burn::tensor::{DType, Shape, TensorData};

use crate::error::{Error, Result};

/// The safetensors metadata key that records the layout a file was written in.
pub const LAYOUT_KEY: &str = "burn_accelerate_layout";

/// How tensors are laid out in a safetensors checkpoint.
///
/// The default is PyTorch's: a `model.safetensors` in Hugging Face's file layout is expected to load into the
/// matching `torch.nn` module, and a Burn ↔ Burn round trip stays exact either way (the load converts back).
/// A file records the layout it was written in, and loading follows that record; files without one (written
/// by PyTorch or Hugging Face tools) are read as PyTorch's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightLayout {
    /// PyTorch's: Linear weights `[out, in]`, normalisation parameters `weight`/`bias`.
    #[default]
    PyTorch,
    /// Burn's own: Linear weights `[in, out]`, normalisation parameters `gamma`/`beta`.
    Burn,
}

impl WeightLayout {
    /// The name recorded in a file's metadata.
    pub fn tag(self) -> &'static str {
        match self {
            WeightLayout::PyTorch => "pytorch",
            WeightLayout::Burn => "burn",
        }
    }

    /// The layout a metadata tag names.
    pub fn from_tag(tag: &str) -> Option<Self> {
        match tag {
            "pytorch" => Some(WeightLayout::PyTorch),
            "burn" => Some(WeightLayout::Burn),
            _ => None,
        }
    }

    /// The tensor as this layout stores it: its key and data, for a parameter at `name` (dotted path) inside
    /// the modules `containers` (outermost first, e.g. `["Struct:Net", "Struct:Linear"]`).
    pub(crate) fn stored(
        self,
        name: String,
        data: TensorData,
        containers: &[String],
    ) -> Result<(String, TensorData)> {
        match self {
            WeightLayout::Burn => Ok((name, data)),
            WeightLayout::PyTorch => {
                let adapted = BurnToPyTorchAdapter.adapt(
                    bridge::from_data(data, name, None),
                    ModuleContext::new(containers),
                );
                let key = adapted.name.clone();
                let data = bridge::into_data(adapted).map_err(|e| {
                    Error::InvalidArgument(format!(
                        "save_model: converting `{key}` to PyTorch's layout: {e}"
                    ))
                })?;
                Ok((key, data))
            }
        }
    }

    /// The key and shape under which this layout stores a parameter of `shape` at `name` (no data is read).
    pub(crate) fn file_key(
        self,
        name: &str,
        dtype: DType,
        shape: &[usize],
        containers: &[String],
    ) -> (String, Vec<usize>) {
        match self {
            WeightLayout::Burn => (name.to_string(), shape.to_vec()),
            WeightLayout::PyTorch => {
                let probe = bridge::deferred(
                    name.to_string(),
                    dtype,
                    Shape::from(shape.to_vec()),
                    None,
                    || unreachable!("only the key and shape of the probe are read"),
                );
                let adapted = BurnToPyTorchAdapter.adapt(probe, ModuleContext::new(containers));
                (adapted.name.clone(), adapted.shape.to_vec())
            }
        }
    }

    /// Stored data of the parameter at `name` (Burn's path) back in Burn's layout.
    pub(crate) fn restored(
        self,
        name: &str,
        data: TensorData,
        containers: &[String],
    ) -> std::result::Result<TensorData, String> {
        match self {
            WeightLayout::Burn => Ok(data),
            WeightLayout::PyTorch => {
                let adapted = PyTorchToBurnAdapter.adapt(
                    bridge::from_data(data, name.to_string(), None),
                    ModuleContext::new(containers),
                );
                bridge::into_data(adapted).map_err(|e| e.to_string())
            }
        }
    }
}

/// Ordered key-renaming rules: each regex replaces every match in the key, in turn (burn-store's
/// `KeyRemapper` semantics).
///
/// ```
/// use burn_accelerate::checkpoint::KeyRemap;
/// let remap = KeyRemap::new().strip_prefix("model.")?.rule(r"^layers\.(\d+)\.", "blocks.$1.")?;
/// assert_eq!(remap.apply("model.layers.3.weight").as_deref(), Some("blocks.3.weight"));
/// assert_eq!(remap.apply("head.bias"), None); // unchanged
/// # Ok::<(), burn_accelerate::Error>(())
/// ```
#[derive(Debug, Clone, Default)]
pub struct KeyRemap(KeyRemapper);

impl KeyRemap {
    /// No rules.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a rule: `pattern` (a regex) is replaced by `replacement` (`$1` names a capture group).
    ///
    /// # Errors
    /// An invalid regex (the error shows it).
    pub fn rule(self, pattern: &str, replacement: &str) -> Result<Self> {
        self.0
            .add_pattern(pattern, replacement)
            .map(Self)
            .map_err(|e| {
                Error::InvalidArgument(format!("key remapping: invalid pattern `{pattern}`: {e}"))
            })
    }

    /// Adds a rule that removes `prefix` from the start of keys.
    ///
    /// # Errors
    /// Never for a plain prefix (it is escaped); kept as `Result` like [`rule`](Self::rule).
    pub fn strip_prefix(self, prefix: &str) -> Result<Self> {
        let pattern = format!("^{}", escape(prefix));
        self.rule(&pattern, "")
    }

    /// Whether there are no rules.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The renamed key, or `None` when no rule changes it.
    pub fn apply(&self, key: &str) -> Option<String> {
        let mut out = key.to_string();
        for (pattern, replacement) in &self.0.patterns {
            if pattern.is_match(&out) {
                out = pattern.replace_all(&out, replacement.as_str()).to_string();
            }
        }
        (out != key).then_some(out)
    }
}

/// `text` with regex metacharacters escaped.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}
