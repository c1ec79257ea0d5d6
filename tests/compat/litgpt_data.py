"""Random token sequences for litgpt's ``pretrain`` (``--data litgpt_data.RandomTokens``): a litgpt ``DataModule`` of
the tests' own, so nothing is downloaded and no tokenizer is needed. Imported only in the litgpt environment."""

import torch
from litgpt.data import DataModule
from torch.utils.data import DataLoader


class RandomTokens(DataModule):
    """``samples`` sequences of ``max_seq_length + 1`` token ids below ``vocab_size``; validation has its own."""

    def __init__(self, vocab_size: int = 128, samples: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.vocab_size, self.samples, self.seed = vocab_size, samples, seed
        self.batch_size, self.max_seq_length = 1, 16

    def connect(self, tokenizer=None, batch_size: int = 1, max_seq_length=None, **kwargs) -> None:
        self.batch_size, self.max_seq_length = batch_size, max_seq_length or 16

    def _tokens(self, offset: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(self.seed + offset)
        return torch.randint(0, self.vocab_size, (self.samples, self.max_seq_length + 1), generator=generator)

    def train_dataloader(self) -> DataLoader:
        shuffled = torch.Generator().manual_seed(1)
        return DataLoader(self._tokens(0), batch_size=self.batch_size, shuffle=True, generator=shuffled)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self._tokens(1), batch_size=self.batch_size)


WORDS = (
    "below", "is", "an", "instruction", "that", "describes", "a", "task", "write", "response", "appropriately",
    "completes", "the", "request", "input", "paired", "with", "provides", "further", "context",
)  # fmt: skip
"""The words of litgpt's Alpaca prompt template, so that its prompts tokenize to known ids."""


def write_checkpoint(directory: str, model_config: dict, samples: int = 24) -> None:
    """A litgpt checkpoint directory of a random-initialised model (``lit_model.pth``, ``model_config.yaml``), a
    word-level tokenizer of the model's vocabulary, and ``instructions.json``, Alpaca-style samples built from it."""
    import json
    from pathlib import Path

    from litgpt import GPT, Config
    from litgpt.utils import save_config
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    config = Config(**model_config)
    torch.manual_seed(0)
    torch.save(GPT(config).state_dict(), folder / "lit_model.pth")
    save_config(config, folder)
    specials = ["<unk>", "<s>", "</s>"]
    filler = [f"w{i}" for i in range(config.padded_vocab_size - len(specials) - len(WORDS) - 3)]
    words = [*specials, *WORDS, "###", ":", ".", *filler]
    tokenizer = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    special = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False, "tokenizer_class": "Fast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(special))
    generator = torch.Generator().manual_seed(2)
    pick = lambda n: " ".join(filler[i] for i in torch.randint(0, len(filler), (n,), generator=generator))  # noqa: E731
    rows = [{"instruction": pick(3), "input": "", "output": pick(4)} for _ in range(samples)]
    (folder / "instructions.json").write_text(json.dumps(rows))
