"""The CPU demo (`make demo`): train llama-tiny on the embedded Wikipedia data under bf16 and two
simulated low-precision schemes, capture one training iteration of each trained model, and
write the analysis report. Every run trains in bf16 (--bf16): the bf16 scheme is a real bf16
run and the others differ from it only in their simulated GEMMs.

For each scheme:
  1. train `--train-iters` iterations, logging to runs/demo/logs/{scheme}.log and TensorBoard
     (with quantization telemetry every --quant-stats-interval iterations), saving the
     checkpoint to runs/demo/checkpoints/{scheme};
  2. resume from that checkpoint for one more iteration with tensor capture on
     (runs/demo/tensors/{scheme}/), so the captured tensors are those of the trained model;
then `tools/visualization/tensor_visualizer.py` turns the captures, the three training logs and
the telemetry into runs/demo/report/report.html.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from megatron.training.child_env import with_repository_path  # noqa: E402

DEFAULT_SCHEMES = ("bf16", "FA_linear_mxfp8", "FA_linear_mxfp4")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES),
                        help="Quantization schemes to train (default: %(default)s).")
    parser.add_argument("--train-iters", type=int, default=30,
                        help="Training iterations per scheme (default: %(default)s).")
    parser.add_argument("--seq-length", type=int, default=128,
                        help="Sequence length (default: %(default)s).")
    parser.add_argument("--micro-batch-size", type=int, default=2,
                        help="Micro-batch size (default: %(default)s).")
    parser.add_argument("--global-batch-size", type=int, default=4,
                        help="Global batch size (default: %(default)s; 2 micro-batches).")
    parser.add_argument("--quant-stats-interval", type=int, default=5,
                        help="Quantization telemetry every N training iterations (default: "
                             "%(default)s; 0 = off), shown over time in the report.")
    parser.add_argument("--data-root", default=os.path.join(REPO_ROOT, "data"),
                        help="Where the embedded datasets live (built if missing).")
    parser.add_argument("--output-dir", default=os.path.join(REPO_ROOT, "runs", "demo"),
                        help="Where logs, checkpoints, captures and the report go "
                             "(default: runs/demo).")
    return parser.parse_args(argv)


def run_logged(cmd, log_path):
    """Run `cmd`, echoing its output to the terminal and to `log_path`; raise on failure."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=with_repository_path(REPO_ROOT))
        for line in proc.stdout:
            log.write(line)
            if "lm loss" in line or "error" in line.lower() or "capture" in line \
                    or "exiting" in line or "saved checkpoint" in line:
                print("    " + line.rstrip(), flush=True)
        if proc.wait() != 0:
            raise SystemExit(f"error: command failed with exit code {proc.returncode}; "
                             f"see {log_path}")


def main(argv=None):
    args = parse_args(argv)
    from megatron.training.corpora import ensure_embedded_dataset

    start = time.time()
    prefix = ensure_embedded_dataset("wikipedia", data_root=args.data_root)
    out = args.output_dir
    logs, ckpts, tensors, report = (os.path.join(out, d)
                                    for d in ("logs", "checkpoints", "tensors", "report"))
    for d in (logs, ckpts, tensors):
        os.makedirs(d, exist_ok=True)

    common = [
        sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"),
        "--model-preset", "llama-tiny", "--data-path", prefix, "--split", "98,2,0",
        "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
        "--global-batch-size", str(args.global_batch_size), "--bf16",
        "--lr", "3e-3", "--min-lr", "3e-4",
        "--lr-warmup-iters", "3", "--lr-decay-style", "cosine",
        "--lr-decay-iters", str(args.train_iters), "--log-interval", "2",
        "--eval-interval", str(args.train_iters), "--eval-iters", "2", "--num-workers", "0",
        "--data-cache-path", os.path.join(out, "data-cache"),
    ]
    loss_logs = []
    for scheme in args.schemes:
        ckpt = os.path.join(ckpts, scheme)
        t0 = time.time()
        print(f"[demo] {scheme}: training {args.train_iters} iterations", flush=True)
        train_log = os.path.join(logs, f"{scheme}.log")
        run_logged(common + ["--quant-scheme", scheme, "--train-iters", str(args.train_iters),
                             "--save", ckpt, "--tensorboard-dir",
                             os.path.join(out, "tensorboard", scheme),
                             "--quant-stats-interval", str(args.quant_stats_interval)],
                   train_log)
        loss_logs.append(f"{scheme}={train_log}")
        print(f"[demo] {scheme}: capturing one iteration of the trained model", flush=True)
        run_logged(common + ["--quant-scheme", scheme, "--train-iters",
                             str(args.train_iters + 1), "--load", ckpt, "--save-tensors",
                             "--tensor-save-dir", tensors, "--control-iter", "1",
                             "--collect-micro-batches", "1",
                             # the transformer layers; the 128256-wide output layer would
                             # multiply the capture size for little insight
                             "--tensor-save-layers", "1-4"],
                   os.path.join(logs, f"{scheme}-capture.log"))
        print(f"[demo] {scheme}: done in {time.time() - t0:.0f} s", flush=True)

    print("[demo] analysing captures and loss curves", flush=True)
    subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "visualization",
                                                 "tensor_visualizer.py"),
                    "--tensor-dir", tensors, "--output-dir", report, "--no-progress",
                    "--loss-logs", *loss_logs,
                    "--tensorboard-dir", os.path.join(out, "tensorboard")], check=True,
                   env=with_repository_path(REPO_ROOT))
    print(f"\n[demo] finished in {(time.time() - start) / 60:.1f} min")
    print(f"  training logs : {logs}")
    print(f"  checkpoints   : {ckpts}")
    print(f"  tensorboard   : {os.path.join(out, 'tensorboard')}")
    print(f"  captures      : {tensors}")
    print(f"  report        : {os.path.join(report, 'report.html')}")


if __name__ == "__main__":
    main()
