"""A Composer program using ``composer.utils.dist``, for tests/compat/test_composer_dist.py:
``python composer_dist_program.py OUT_DIR [initialize_dist]`` (under ``fabric run model --drop-in=composer -n 2``). It
reads the process facts before and after the process group exists (the Trainer initialises it, or, with
``initialize_dist``, the program does first, as llm-foundry does), runs every collective and the node's signal-file
wait, and writes what each rank saw to ``OUT_DIR/rank<R>.json``."""

import json
import os
import sys
from pathlib import Path

import torch
from composer import Trainer
from composer.models import ComposerClassifier
from composer.utils import dist, get_device
from torch.utils.data import DataLoader, TensorDataset

out = Path(sys.argv[1])
facts = [dist.get_world_size(), dist.get_global_rank(), dist.get_local_rank(), dist.get_local_world_size()]
report: dict[str, object] = {"before": [*facts, dist.get_node_rank(), dist.is_initialized()]}
if "initialize_dist" in sys.argv[2:]:
    dist.initialize_dist(get_device(None), timeout=120)
    report["initialized_by_program"] = [dist.is_initialized(), dist.get_world_size(), torch.distributed.get_backend()]
    group = torch.distributed.distributed_c10d._get_default_group()
data = TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
model = ComposerClassifier(torch.nn.Linear(4, 2), num_classes=2)
trainer = Trainer(model=model, train_dataloader=DataLoader(data, batch_size=4), max_duration="1ba", device="cpu")
rank = dist.get_global_rank()
report["after"] = [dist.get_world_size(), rank, dist.is_initialized()]
if "initialize_dist" in sys.argv[2:]:
    report["trainer_adopted_the_group"] = torch.distributed.distributed_c10d._get_default_group() is group
report["trained_batches"] = int(trainer.state.timestamp.batch) if trainer.fit() is None else -1

summed = torch.tensor([float(rank + 1)])
dist.all_reduce(summed)
largest = torch.tensor([rank + 1])
dist.all_reduce(largest, reduce_operation="max")
report["all_reduce"] = [summed.item(), largest.item()]
report["all_gather"] = [t.tolist() for t in dist.all_gather(torch.tensor([rank, rank * 10]))]
report["all_gather_object"] = dist.all_gather_object({"rank": rank})
objects = [f"from rank {rank}", rank]
dist.broadcast_object_list(objects, src=1)
report["broadcast_object_list"] = objects
tensor = torch.full((2,), float(rank))
dist.broadcast(tensor, src=1)
report["broadcast"] = tensor.tolist()
report["sampler"] = list(dist.get_sampler(range(10)))
report["shuffled"] = [list(dist.get_sampler(range(10), shuffle=True, seed=seed)) for seed in (0, 0, 1)]

marker = out / "written-by-local-rank-zero"
with dist.run_local_rank_zero_first():
    if dist.get_local_rank() == 0:
        marker.write_text("done")  # the other local ranks run the block only after this
    report["marker_seen_in_block"] = marker.exists()
download = out / "downloaded"
if dist.get_local_rank() == 0:  # a download lands whole (written aside, renamed): the others wait for its name
    (out / "downloaded.partial").write_text("data")
    os.replace(out / "downloaded.partial", download)
with dist.local_rank_zero_download_and_wait(str(download)):
    report["download_seen"] = download.read_text()
signal_name = dist.get_node_signal_file_name()
report["signal_name"] = signal_name
with dist.local_rank_zero_download_and_wait(str(out / signal_name)):
    pass  # local rank zero's setup would run here; the others wait for its file before going on
if dist.get_local_rank() == 0:
    report["signal_written"] = dist.write_signal_file(signal_name, str(out)) == str(out / signal_name)
dist.barrier()
(out / f"rank{rank}.json").write_text(json.dumps(report))
