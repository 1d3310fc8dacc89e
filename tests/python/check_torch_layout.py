"""Checks a checkpoint burn-accelerate saved in PyTorch's layout against the same weights saved in Burn's.

usage: check_torch_layout.py TORCH_LAYOUT.safetensors BURN_LAYOUT.safetensors
Names and shapes must be exactly PyTorch's (net.TORCH_SHAPES); values must equal Burn's under the documented
conversions: Linear weights transposed, LayerNorm gamma/beta renamed weight/bias, everything else as is.
"""

import sys

import numpy as np
import safetensors.numpy as st

from net import TORCH_SHAPES

torch_file, burn_file = sys.argv[1], sys.argv[2]
torch = st.load_file(torch_file)
burn = st.load_file(burn_file)

shapes = {name: tuple(t.shape) for name, t in torch.items()}
assert shapes == TORCH_SHAPES, f"names/shapes {shapes} != {TORCH_SHAPES}"

burn_of = {
    "norm.weight": ("norm.gamma", lambda a: a),
    "norm.bias": ("norm.beta", lambda a: a),
    "fc1.weight": ("fc1.weight", lambda a: a.T),
    "fc2.weight": ("fc2.weight", lambda a: a.T),
}
for name, value in torch.items():
    source, convert = burn_of.get(name, (name, lambda a: a))
    expected = convert(burn[source])
    assert value.dtype == expected.dtype, (name, value.dtype, expected.dtype)
    assert np.array_equal(value, expected), f"{name} differs from Burn's {source}"
print(f"torch layout ok: {len(torch)} tensors")
