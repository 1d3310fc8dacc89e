"""By hand, with PyTorch installed: the Burn-saved checkpoint loads into the torch.nn module of the same
architecture with load_state_dict(strict=True), and both give the same outputs.

usage: torch_load_state_dict.py DIR   (DIR holds model.safetensors and burn_output.json from tests/suite/pytorch_layout.rs,
                                       kept with BURN_ACCELERATE_KEEP_DIR=DIR)
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(2, 4, 3)
        self.norm = torch.nn.LayerNorm(24, eps=1e-5)
        self.fc1 = torch.nn.Linear(24, 16)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        h = self.conv(x).flatten(1)
        return self.fc2(torch.relu(self.fc1(self.norm(h))))


d = sys.argv[1]
net = Net()
missing_unexpected = net.load_state_dict(load_file(os.path.join(d, "model.safetensors")), strict=True)
burn = json.load(open(os.path.join(d, "burn_output.json")))
x = torch.tensor(burn["input"], dtype=torch.float32).reshape(burn["shape"])
with torch.no_grad():
    y = net(x).numpy().ravel()
diff = max(abs(a - b) for a, b in zip(y.tolist(), burn["output"]))
print(f"torch {torch.__version__}: load_state_dict(strict=True) {missing_unexpected}; max |torch - burn| = {diff:.3e}")
assert diff <= 1e-5, diff
