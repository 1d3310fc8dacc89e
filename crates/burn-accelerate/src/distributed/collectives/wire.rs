//! Tensors as bytes for the byte-level collectives: a small header (dtype, shape) followed by the row-major data.

use burn::tensor::{DType, TensorData};
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

#[derive(Serialize, Deserialize)]
struct Header {
    dtype: DType,
    shape: Vec<usize>,
}

/// A decoded message: dtype, shape and the raw element bytes.
pub(crate) struct Decoded {
    pub dtype: DType,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

pub(crate) fn encode(data: &TensorData) -> Result<Vec<u8>> {
    if matches!(data.dtype(), DType::QFloat(_)) {
        return Err(Error::InvalidArgument(
            "collectives on quantized tensors are not supported; dequantize first".into(),
        ));
    }
    let header = serde_json::to_vec(&Header {
        dtype: data.dtype(),
        shape: data.shape().to_vec(),
    })
    .map_err(|e| Error::InvalidArgument(format!("cannot encode a tensor header: {e}")))?;
    let bytes = data.as_bytes();
    let mut out = Vec::with_capacity(4 + header.len() + bytes.len());
    out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(bytes);
    Ok(out)
}

pub(crate) fn decode(mut message: Vec<u8>, rank: usize) -> Result<Decoded> {
    let bad = |why: &str| {
        Error::InvalidArgument(format!(
            "tensor received from rank {rank} is malformed: {why}"
        ))
    };
    if message.len() < 4 {
        return Err(bad("shorter than its header"));
    }
    let len = u32::from_le_bytes(message[..4].try_into().expect("4 bytes")) as usize;
    let header: Header = serde_json::from_slice(
        message
            .get(4..4 + len)
            .ok_or_else(|| bad("truncated header"))?,
    )
    .map_err(|e| bad(&e.to_string()))?;
    let expected = header.shape.iter().product::<usize>() * header.dtype.size();
    let bytes = message.split_off(4 + len);
    if bytes.len() != expected {
        return Err(bad(&format!(
            "{} data bytes for a {:?} {:?} tensor",
            bytes.len(),
            header.shape,
            header.dtype
        )));
    }
    Ok(Decoded {
        dtype: header.dtype,
        shape: header.shape,
        bytes,
    })
}

impl Decoded {
    pub(crate) fn into_data(self) -> TensorData {
        TensorData::from_bytes_vec(self.bytes, self.shape, self.dtype)
    }
}

/// A shape printed like a Python list, as Accelerate's messages do: `[1, 5]`.
pub(crate) fn shape_str(shape: &[usize]) -> String {
    format!("{shape:?}")
}
