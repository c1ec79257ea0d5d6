"""``Generate``: every ``interval``, a Hugging Face model writes a continuation of each prompt, and rank 0 logs the
prompts and generations as the table ``generations`` (Composer's callback, which llm-foundry registers as
``generate_callback``).

Generation runs on every rank (a sharded model's layers are gathered in its forwards, so no rank may skip it) with
the model in eval mode and the tokenizer padding on the left, both restored afterwards; keyword arguments go to
``transformers``' ``generate`` (``max_new_tokens=``, ``do_sample=``, ...).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from typing_extensions import override

from fabric.trainer.callbacks._utils import user_model
from fabric.trainer.core.callback import Callback
from fabric.trainer.core.events import Event
from fabric.trainer.core.logger import Logger
from fabric.trainer.core.state import State, require_fabric
from fabric.trainer.intervals import IntervalInput, create_interval


class Generate(Callback):
    """Generate from ``prompts`` every ``interval`` (``"100ba"``, ``"1ep"``; also when training ends), in batches of
    ``batch_size`` prompts (default: all at once)."""

    def __init__(
        self, prompts: Sequence[str], interval: IntervalInput, batch_size: int | None = None, **generate_kwargs: Any
    ) -> None:
        if isinstance(prompts, str) or not prompts or not all(isinstance(prompt, str) for prompt in prompts):
            raise ValueError(f"Generate(prompts={prompts!r}): give a non-empty list of strings.")
        whole = isinstance(batch_size, int) and not isinstance(batch_size, bool)
        if batch_size is not None and (not whole or batch_size < 1):
            raise ValueError(f"Generate(batch_size={batch_size!r}) must be a positive int or None.")
        self.prompts = list(prompts)
        self.batch_size = batch_size or len(self.prompts)
        self.generate_kwargs = generate_kwargs
        self.interval = create_interval(interval, name="Generate(interval)")
        self.last_generate_batch: int | None = None

    @override
    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.interval(state, Event.BATCH_END):
            self._generate(state, logger)

    @override
    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        if self.interval(state, Event.EPOCH_END):
            self._generate(state, logger)

    def _generate(self, state: State, logger: Logger) -> None:
        """Generate now (on every rank) and log the table from rank 0."""
        from fabric.trainer.huggingface import HuggingFaceModel

        fabric = require_fabric(state)
        model = user_model(state)
        if not isinstance(model, HuggingFaceModel) or model.tokenizer is None:
            raise ValueError(
                f"Generate needs a HuggingFaceModel with a tokenizer (to encode the prompts and call the Hugging Face "
                f"model's generate), got {type(model).__name__}."
            )
        self.last_generate_batch = int(state.timestamp.batch)
        tokenizer, training = model.tokenizer, model.training
        padding_side, pad_token_id = tokenizer.padding_side, tokenizer.pad_token_id
        tokenizer.padding_side = "left"  # generation continues each prompt from its last token
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token_id = tokenizer.eos_token_id
        try:
            model.eval()
            encoded = tokenizer(self.prompts, return_tensors="pt", padding=True)
            generated: list[torch.Tensor] = []
            with torch.no_grad(), fabric.autocast():
                for start in range(0, len(self.prompts), self.batch_size):
                    input_ids = fabric.to_device(encoded["input_ids"][start : start + self.batch_size])
                    attention_mask = fabric.to_device(encoded["attention_mask"][start : start + self.batch_size])
                    generated.extend(
                        model.model.generate(
                            input_ids=input_ids,
                            attention_mask=attention_mask,
                            synced_gpus=fabric.world_size > 1,
                            **self.generate_kwargs,
                        )
                    )
        finally:
            tokenizer.padding_side, tokenizer.pad_token_id = padding_side, pad_token_id
            model.train(training)
        if fabric.global_rank == 0:
            prompt_length = encoded["input_ids"].shape[1]
            rows = [
                [prompt, tokenizer.decode(tokens[prompt_length:], skip_special_tokens=True)]
                for prompt, tokens in zip(self.prompts, generated, strict=True)
            ]
            logger.log_table(columns=["prompt", "generation"], rows=rows, name="generations")
