"""A small byte-level BPE tokenizer trained on a corpus, for fast CPU studies.

With the 128,256-entry Llama 3 vocabulary the output layer is ~98% of a tiny model's FLOPs,
so a CPU study of quantized transformer blocks would mostly measure the LM head. A vocabulary
of a few thousand entries trained on the corpus itself makes the blocks the work again.

The tokenizer follows Llama 3's design at a smaller size: the same pre-tokenization regex,
byte-level symbols (all 256 bytes are in the vocabulary, so nothing is ever unknown) and the
special tokens `<|begin_of_text|>` / `<|end_of_text|>` (end of document), saved as a
HuggingFace `tokenizer.json` that `--tokenizer-type HuggingFaceTokenizer --tokenizer-model`
loads. Training is deterministic: the same documents in the same order and the same vocabulary
size give a byte-identical file (HF tokenizers breaks ties between equally frequent pairs by
the pair itself, not by hash order).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Iterable, Iterator

from megatron.training.tokenizer import LLAMA3_PATTERN

SPECIAL_TOKENS = ("<|begin_of_text|>", "<|end_of_text|>")
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)    # every byte plus the specials
DEFAULT_VOCAB_SIZE = 8192
MIN_PAIR_FREQUENCY = 2                        # a merge seen once is noise, not vocabulary


def check_vocab_size(vocab_size: int) -> int:
    if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"BPE vocabulary size {vocab_size!r} is too small: it must be an "
                         f"integer >= {MIN_VOCAB_SIZE} (256 bytes + {len(SPECIAL_TOKENS)} "
                         "special tokens)")
    return vocab_size


def read_jsonl_texts(path: os.PathLike, key: str = "text") -> Iterator[str]:
    """The `key` field of every line of a jsonl file, in file order."""
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)[key]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{number}: not a JSON object with a {key!r} "
                                 "field") from None


def train_bpe(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE):
    """A `tokenizers.Tokenizer` with `vocab_size` entries (bytes, specials, merges)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    check_vocab_size(vocab_size)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=MIN_PAIR_FREQUENCY,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def save_tokenizer(tokenizer, path: os.PathLike) -> Path:
    """Write tokenizer.json atomically (temporary name, then rename); returns the path."""
    path = Path(path)
    if path.suffix != ".json":
        path = path / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    os.replace(tmp, path)
    return path
