"""The test network of tests/suite/pytorch_layout.rs in numpy, with PyTorch's parameter names and layouts.

conv: Conv1d(2 -> 4, kernel 3, no padding); flatten to 24; norm: LayerNorm(24, eps 1e-5);
fc1: Linear(24 -> 16); ReLU; fc2: Linear(16 -> 3).
"""

import numpy as np

# PyTorch's names and shapes for this network (what torch.nn gives the same architecture).
TORCH_SHAPES = {
    "conv.weight": (4, 2, 3),
    "conv.bias": (4,),
    "norm.weight": (24,),
    "norm.bias": (24,),
    "fc1.weight": (16, 24),
    "fc1.bias": (16,),
    "fc2.weight": (3, 16),
    "fc2.bias": (3,),
}


def forward(p, x):
    """The network's output for input x of shape [batch, 2, 8], in float64."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    x = x.astype(np.float64)
    batch, _, length = x.shape
    out_len = length - 3 + 1
    h = np.zeros((batch, 4, out_len))
    for t in range(out_len):
        h[:, :, t] = np.einsum("bik,oik->bo", x[:, :, t : t + 3], p["conv.weight"]) + p["conv.bias"]
    h = h.reshape(batch, 24)
    mean = h.mean(axis=1, keepdims=True)
    var = h.var(axis=1, keepdims=True)
    h = (h - mean) / np.sqrt(var + 1e-5) * p["norm.weight"] + p["norm.bias"]
    h = np.maximum(h @ p["fc1.weight"].T + p["fc1.bias"], 0.0)
    return h @ p["fc2.weight"].T + p["fc2.bias"]
