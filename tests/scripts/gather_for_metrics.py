"""``fabric.gather_for_metrics`` on 2 ranks: ``python gather_for_metrics.py OUT_DIR``.

101 samples (the values 0..100) over 2 ranks: DistributedSampler gives each rank 51, repeating sample 0.
Rank 0 writes to ``OUT_DIR/report.json`` what ``all_gather`` and ``gather_for_metrics`` returned: per batch
in order, per batch shuffled over two epochs, after a pass broken off early, and for a whole pass at once.
"""

import json
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
fabric.launch()
values = torch.arange(101)
data = TensorDataset(values, values % 3 == 0)  # a "prediction is correct" flag for every third sample
ordered = fabric.setup_dataloaders(DataLoader(data, batch_size=10))
shuffled = fabric.setup_dataloaders(DataLoader(data, batch_size=10, shuffle=True))
report: dict[str, object] = {}

report["all_gather_rows"] = sum(fabric.all_gather(x).numel() for x, _ in ordered)
report["in_order"] = torch.cat([fabric.gather_for_metrics(x, ordered) for x, _ in ordered]).tolist()
correct = [fabric.gather_for_metrics({"correct": flag}, ordered)["correct"] for _, flag in ordered]
report["correct_count"] = int(torch.cat(correct).sum())
report["shuffled_epochs"] = [
    sorted(torch.cat([fabric.gather_for_metrics(x, shuffled) for x, _ in shuffled]).tolist()) for _ in range(2)
]
for step, (x, _) in enumerate(ordered):  # broken off: the next pass starts counting afresh
    fabric.gather_for_metrics(x, ordered)
    if step == 1:
        break
report["after_a_broken_pass"] = torch.cat([fabric.gather_for_metrics(x, ordered) for x, _ in ordered]).tolist()
whole = torch.cat([x for x, _ in ordered])
report["whole_pass_at_once"] = fabric.gather_for_metrics(whole, ordered).tolist()
try:
    fabric.gather_for_metrics(whole, ordered)  # the same pass again: more rows than the rank has samples
except ValueError as error:
    report["too_many_rows"] = str(error)
if fabric.is_global_zero:
    (Path(sys.argv[1]) / "report.json").write_text(json.dumps(report))
