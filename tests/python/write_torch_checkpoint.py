"""Writes a checkpoint of the test network the way PyTorch / Hugging Face tools do (PyTorch's layout, no layout
record), with an input and the output numpy computes for it.

usage: write_torch_checkpoint.py OUT_DIR
Writes OUT_DIR/model.safetensors and OUT_DIR/expected.json ({"input": [...], "shape": [...], "output": [...]}).
"""

import json
import os
import sys

import numpy as np
import safetensors.numpy as st

from net import TORCH_SHAPES, forward

out = sys.argv[1]
rng = np.random.default_rng(7)
params = {name: rng.normal(0.0, 0.5, size=shape).astype(np.float32) for name, shape in TORCH_SHAPES.items()}
st.save_file(params, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
x = rng.normal(0.0, 1.0, size=(2, 2, 8)).astype(np.float32)
y = forward(params, x)
with open(os.path.join(out, "expected.json"), "w") as f:
    json.dump({"input": x.ravel().tolist(), "shape": list(x.shape), "output": y.ravel().tolist()}, f)
print("written")
