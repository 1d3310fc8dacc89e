"""Reads a TensorBoard log folder with TensorBoard's own loader and prints what it holds, as JSON:
{"scalars": {tag: [[step, value], ...]}, "texts": {tag: [[step, text], ...]}}; a non-finite scalar is written
as its string ("nan", "inf"), which strict JSON readers accept."""
import json
import math
import sys

from tensorboard.backend.event_processing import event_accumulator

acc = event_accumulator.EventAccumulator(
    sys.argv[1],
    size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0},
)
acc.Reload()
tags = acc.Tags()
out = {"scalars": {}, "texts": {}}
for tag in tags.get("scalars", []):
    out["scalars"][tag] = [
        [e.step, e.value if math.isfinite(e.value) else str(e.value)] for e in acc.Scalars(tag)
    ]
for tag in tags.get("tensors", []):
    meta = acc.SummaryMetadata(tag)
    if meta.plugin_data.plugin_name == "text":
        out["texts"][tag] = [
            [e.step, b"".join(e.tensor_proto.string_val).decode()] for e in acc.Tensors(tag)
        ]
print(json.dumps(out, allow_nan=False))
