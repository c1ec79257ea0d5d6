"""The reference for llm-foundry's in-context learning evaluation, without the Trainer: llm-foundry builds the tasks'
evaluators and the MPT (through the Composer drop-in mode, for its imports), the checkpoint's weights are loaded, and
each task's batches (at most ``icl_subset_num_batches`` of them) go through the model and into the task's metric by
hand, the way Composer's ``HuggingFaceModel`` feeds them: the batch's labels one position earlier (the last ignored),
the logits of every position (generation tasks are left out). Writes ``{"metrics/<label>/<metric>": value}`` as JSON.

Usage: ``python -m fabric.compat.composer foundry_icl_reference.py EVAL_CONFIG.json OUTPUT.json``
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import torch
from llmfoundry.utils.builders import build_composer_model, build_icl_evaluators, build_tokenizer


def main(config_path: str, output_path: str) -> None:
    config = json.loads(Path(config_path).read_text())
    (model_config,) = config["models"]
    tokenizer = build_tokenizer(model_config["tokenizer"]["name"], model_config["tokenizer"]["kwargs"])
    model_settings = dict(model_config["model"])
    model = build_composer_model(model_settings.pop("name"), model_settings, tokenizer)
    model.load_state_dict(torch.load(model_config["load_path"], weights_only=False)["model"])
    model.eval()
    evaluators, _ = build_icl_evaluators(
        config["icl_tasks"], tokenizer, config["max_seq_len"], config["device_eval_batch_size"],
        icl_subset_num_batches=config["icl_subset_num_batches"],
    )  # fmt: skip
    values = {}
    for evaluator in evaluators:
        metrics = {name: copy.deepcopy(model.get_metrics(is_train=False)[name]) for name in evaluator.metric_names}
        for index, batch in enumerate(evaluator.dataloader.dataloader):
            if index == evaluator.subset_num_batches or batch["mode"] != "icl_task":  # generation tasks: not here
                break
            labels = batch.pop("labels")
            labels = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)
            with torch.no_grad():
                logits = model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            for metric in metrics.values():
                metric.update(batch=batch, outputs=logits, labels=labels)
        if index > 0:
            values |= {f"metrics/{evaluator.label}/{name}": float(metric.compute()) for name, metric in metrics.items()}
    Path(output_path).write_text(json.dumps(values))


if __name__ == "__main__":
    main(*sys.argv[1:])
