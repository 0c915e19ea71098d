"""Training throughput of llama-tiny in bf16 on the CPU: the Llama 3 vocabulary (128,256)
against the 8,192-entry BPE of the study path, on the same Wikipedia documents, side by side
in one process. Target: >= 3,000 tokens/s with the small vocabulary on 2 cores.

    python benchmarks/tokens_per_second.py [--iters 20] [--seq-length 256] [--schemes bf16 ...]

Figures are the median step time after warm-up, as tokens per second of one training using
all the process's threads (OMP_NUM_THREADS; default: every core).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import pretrain_gpt  # noqa: E402
from megatron.training import corpora  # noqa: E402
from megatron.training.training import pretrain  # noqa: E402
from step_timer import StepTimer  # noqa: E402

TARGET = 3000.0


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=20, help="Timed iterations per run.")
    parser.add_argument("--warmup", type=int, default=3, help="Untimed first iterations.")
    parser.add_argument("--seq-length", type=int, default=256, help="Tokens per sample.")
    parser.add_argument("--micro-batch-size", type=int, default=4,
                        help="Samples per micro-batch.")
    parser.add_argument("--global-batch-size", type=int, default=4,
                        help="Samples per iteration.")
    parser.add_argument("--schemes", nargs="+", default=["bf16", "FA_linear_mxfp4"],
                        help="Quantization schemes to time with each vocabulary.")
    parser.add_argument("--data-root", default=os.path.join(REPO_ROOT, "data"),
                        help="Where the embedded corpora are (built there if missing).")
    args = parser.parse_args(argv)

    llama3 = corpora.ensure_embedded_dataset("wikipedia", args.data_root)
    bpe, bpe_tokenizer = corpora.ensure_bpe_dataset("wikipedia", 8192, args.data_root)
    vocabularies = {
        "Llama 3 (128,256)": ["--data-path", llama3, "--tokenizer-type", "Llama3Tokenizer"],
        "BPE 8,192": ["--data-path", bpe, "--tokenizer-type", "HuggingFaceTokenizer",
                      "--tokenizer-model", bpe_tokenizer],
    }
    tokens = args.global_batch_size * args.seq_length
    base = ["--model-preset", "llama-tiny", "--bf16", "--split", "98,2,0",
            "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
            "--global-batch-size", str(args.global_batch_size), "--lr", "1e-3",
            "--train-iters", str(args.iters + args.warmup), "--log-interval", "1000",
            "--eval-iters", "0", "--num-workers", "0",
            "--data-cache-path", os.path.join(args.data_root, ".bench-cache")]
    results = {}
    for scheme in args.schemes:
        for name, flags in vocabularies.items():
            timer = StepTimer()
            pretrain(pretrain_gpt.forward_step, base + flags + ["--quant-scheme", scheme],
                     callbacks=[timer])
            results[(scheme, name)] = tokens / statistics.median(timer.after(args.warmup))
    print(f"\nllama-tiny, bf16, {tokens} tokens per step (seq {args.seq_length}), torch threads "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"{'scheme':<18}{'vocabulary':<20}{'tokens/s':>10}")
    for (scheme, name), rate in results.items():
        print(f"{scheme:<18}{name:<20}{rate:>10.0f}")
    for scheme in args.schemes:
        big, small = results[(scheme, "Llama 3 (128,256)")], results[(scheme, "BPE 8,192")]
        print(f"{scheme}: BPE 8,192 / Llama 3 = {small / big:.1f}x")
    if "bf16" in args.schemes:
        rate = results[("bf16", "BPE 8,192")]
        print(f"bf16 with the BPE: {rate:.0f} tokens/s (target >= {TARGET:.0f}): "
              f"{'met' if rate >= TARGET else 'NOT met'}")


if __name__ == "__main__":
    main()
