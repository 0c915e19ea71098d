"""Command line: train a small byte-level BPE tokenizer (tokenizer.json), deterministically.

    python tools/train_tokenizer.py --dataset wikipedia --vocab-size 8192
        builds data/wikipedia-bpe8192/{tokenizer.json, wikipedia_text_document.bin/.idx}
        (the embedded dataset's documents re-tokenized with it), then prints the flags to
        train on it
    python tools/train_tokenizer.py --input corpus.jsonl --vocab-size 8192 --output tok/
        writes tok/tokenizer.json only (tokenize your data with tools/preprocess_data.py
        --tokenizer-type HuggingFaceTokenizer --tokenizer-model tok/tokenizer.json)

See megatron/training/bpe_tokenizer.py for the design (Llama 3's pre-tokenizer at a small
vocabulary size).
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from megatron.training import bpe_tokenizer, corpora
from megatron.training.tokenizer import TokenizerError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Train a deterministic byte-level BPE tokenizer on a corpus.",
        allow_abbrev=False)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--dataset", choices=corpora.EMBEDDED_DATASETS,
                        help="Train on an embedded dataset (built first if needed) and build "
                             "its {name}-bpe{V} variant: the same documents tokenized with the "
                             "new tokenizer.")
    source.add_argument("--input", type=str,
                        help="Train on a jsonl file (one JSON object per line).")
    parser.add_argument("--vocab-size", type=int, default=bpe_tokenizer.DEFAULT_VOCAB_SIZE,
                        help="Entries in the vocabulary: 256 bytes, "
                             f"{len(bpe_tokenizer.SPECIAL_TOKENS)} special tokens and merges "
                             "(default: %(default)s).")
    parser.add_argument("--json-key", type=str, default="text",
                        help="The text field of --input lines (default: %(default)s).")
    parser.add_argument("--output", type=str, default=None,
                        help="With --input: where tokenizer.json goes (a .json file name or a "
                             "directory; required).")
    parser.add_argument("--data-root", type=str, default=str(corpora.DEFAULT_DATA_ROOT),
                        help="With --dataset: the data root (default: %(default)s, relative to "
                             "the working directory).")
    parser.add_argument("--workers", type=int, default=1,
                        help="With --dataset: tokenizer worker processes for .bin/.idx.")
    parser.add_argument("--force", action="store_true",
                        help="With --dataset: rebuild the variant even if it is built.")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    start = time.perf_counter()
    try:
        bpe_tokenizer.check_vocab_size(args.vocab_size)
        if args.input is not None:
            if args.output is None:
                parser.error("--input needs --output (a tokenizer.json path or a directory)")
            tokenizer = bpe_tokenizer.train_bpe(
                bpe_tokenizer.read_jsonl_texts(args.input, args.json_key), args.vocab_size)
            path = bpe_tokenizer.save_tokenizer(tokenizer, args.output)
            log(f"[tokenizer] {tokenizer.get_vocab_size()} entries -> {path} "
                f"({time.perf_counter() - start:.1f} s)")
            return 0
        prefix, tokenizer_path = corpora.ensure_bpe_dataset(
            args.dataset, args.vocab_size, args.data_root, workers=args.workers, log=log,
            force=args.force)
    except (ValueError, OSError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    log(f"[tokenizer] done in {time.perf_counter() - start:.1f} s; train with:")
    print(f"  --tokenizer-type HuggingFaceTokenizer --tokenizer-model {tokenizer_path} "
          f"--data-path {prefix}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
