"""What llm-foundry's ``train`` needs, made here (nothing is downloaded): ``python foundry_data.py ROOT`` (in the
environment of scripts/foundry_env.sh) writes a word-level tokenizer (``ROOT/tokenizer``, a Hugging Face fast
tokenizer with an end-of-text token) and MDS text shards of random word sequences (``ROOT/data/train``: 360 texts,
``ROOT/data/val``: 40), as mosaicml-streaming's ``MDSWriter`` writes them for llm-foundry's ``text`` loader."""

import random
import sys
from pathlib import Path

from streaming import MDSWriter
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

root = Path(sys.argv[1])
rng = random.Random(0)
words = [f"w{i}" for i in range(200)]
texts = [" ".join(rng.choice(words) for _ in range(rng.randint(40, 120))) for _ in range(400)]
tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[UNK]", "<|endoftext|>", "[PAD]"]))
fast = PreTrainedTokenizerFast(
    tokenizer_object=tokenizer, unk_token="[UNK]", eos_token="<|endoftext|>", pad_token="[PAD]"
)
fast.save_pretrained(root / "tokenizer")
for split, part in (("train", texts[:360]), ("val", texts[360:])):
    with MDSWriter(out=str(root / "data" / split), columns={"text": "str"}) as writer:
        for text in part:
            writer.write({"text": text})
