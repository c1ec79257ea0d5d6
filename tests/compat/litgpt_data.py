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
