"""Kill capture runs at random moments and check what they leave behind.

    python benchmarks/capture_kill.py [--runs 20] [--seed 0] [--window 6] [--out DIR]

Each run starts `pretrain_gpt.py` on a tiny model (mock data) capturing every iteration in
full mode, and sends it SIGKILL at a random moment: the first run once training has started
plus a random delay, later runs at a random time since launch that also covers start-up
(from 0 to 1.2 x the measured start-up time plus `--window` seconds). After each kill:

- manifest valid: every line of every manifest parses as JSON, the file ends with a complete
  line, and each line names an existing record of exactly the listed size that loads with
  weights_only=True;
- analysis ok: megatron.analysis (the library behind tools/visualization/tensor_visualizer.py)
  runs on the directory without an exception and reports the run as unfinished (its
  manifest has no summary file).

Prints one line per run and the counts: runs, kills during training (after the training
loop had started), manifests valid, analysis ok.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from megatron.analysis.pipeline import Options, analyze  # noqa: E402
from megatron.tensor_capture import format as capture_format  # noqa: E402
from megatron.tensor_capture.load import RecordError, load_record  # noqa: E402

SCHEME = "FA_linear_mxfp8"
TRAINING_STARTED = "training from iteration"
RUN_ARGS = [
    "--model-preset", "llama-tiny", "--num-layers", "2", "--hidden-size", "128",
    "--ffn-hidden-size", "384", "--num-attention-heads", "4", "--num-query-groups", "2",
    "--seq-length", "64", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "512",
    "--lr", "3e-3", "--train-iters", "100000", "--log-interval", "1",
    "--eval-interval", "1000000", "--eval-iters", "0", "--num-workers", "0",
    "--quant-scheme", SCHEME, "--save-tensors", "--control-iter", "0",
    "--collect-micro-batches", "2",
]


def manifest_problems(directory: str) -> list:
    """Why the manifests of `directory` are not valid (empty list when they are)."""
    problems = []
    for manifest in capture_format.manifest_files(directory):
        with open(manifest, encoding="utf-8") as f:
            text = f.read()
        if text and not text.endswith("\n"):
            problems.append(f"{manifest}: ends in a partial line")
        for number, line in enumerate(text.splitlines(), 1):
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                problems.append(f"{manifest}:{number}: does not parse")
                continue
            if entry.get("file") is None:
                continue
            path = capture_format.record_path(directory, entry["file"])
            if not os.path.isfile(path) or os.path.getsize(path) != entry.get("bytes"):
                problems.append(f"{manifest}:{number}: {entry['file']} missing or not "
                                f"{entry.get('bytes')} bytes")
                continue
            try:
                load_record(path)
            except (RecordError, OSError) as exc:
                problems.append(f"{manifest}:{number}: {exc}")
    return problems


def analysis_reports_unfinished(root: str, directory: str, out: str, killed: bool):
    """(ok, note): the analysis ran without an exception and, when a killed run had opened its
    manifest, reported the run as unfinished."""
    try:
        result = analyze(Options(tensor_dirs=[root], output_dir=out, workers=1,
                                 progress=False, figures=False))
    except Exception as exc:  # noqa: BLE001 - any exception is the failure being measured
        return False, f"analysis raised {type(exc).__name__}: {exc}"
    kinds = {p["kind"] for p in result.problems.items}
    records = (result.statistics or {}).get("timing", {}).get("records", 0)
    note = f"{records} records analysed, problems: {', '.join(sorted(kinds)) or 'none'}"
    capturing = os.path.isdir(directory) and capture_format.manifest_files(directory)
    return ("unfinished_run" in kinds) if capturing and killed else True, note


def run_once(root: str, log_path: str, delay_from_start, started_delay):
    """Launch, kill, and return (seconds to training start or None, killed at seconds)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"), *RUN_ARGS,
             "--tensor-save-dir", root], env=env, stdout=log, stderr=subprocess.STDOUT)
        launched = time.monotonic()
        started = None
        kill_at = None if delay_from_start is None else launched + delay_from_start
        while proc.poll() is None:
            now = time.monotonic()
            if started is None and TRAINING_STARTED in open(log_path).read():
                started = now - launched
                if kill_at is None:
                    kill_at = now + started_delay
            if kill_at is not None and now >= kill_at:
                break
            time.sleep(0.02)
        killed_at = time.monotonic() - launched
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    if started is None and TRAINING_STARTED in open(log_path).read():
        started = killed_at          # reached the loop in the last poll interval
    return started, killed_at, proc.returncode


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20, help="number of runs (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the kill times")
    parser.add_argument("--window", type=float, default=6.0, metavar="SECONDS",
                        help="kill window after training starts (default 6)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="keep the runs here (default: a temporary directory, removed)")
    args = parser.parse_args(argv)
    logging.getLogger("megatron.analysis").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    base = args.out or tempfile.mkdtemp(prefix="capture-kill-")
    counts = {"runs": 0, "kills during training": 0, "manifests valid": 0, "analysis ok": 0}
    startup = None
    try:
        for run in range(args.runs):
            root = os.path.join(base, f"run{run:03d}")
            os.makedirs(root, exist_ok=True)
            if startup is None:
                plan, after_start = None, rng.uniform(0, args.window)
            else:
                plan, after_start = rng.uniform(0, 1.2 * startup + args.window), None
            started, killed_at, code = run_once(root, os.path.join(root, "train.log"), plan,
                                                after_start)
            if started is not None and startup is None:
                startup = started
            during = started is not None and code == -signal.SIGKILL
            if code != -signal.SIGKILL:       # the run ended by itself: say how
                with open(os.path.join(root, "train.log")) as f:
                    last = (f.read().strip().splitlines() or [""])[-1]
                print(f"run {run + 1:3d}: exited by itself with code {code} before the kill: "
                      f"{last}", flush=True)
            directory = os.path.join(root, SCHEME)
            problems = manifest_problems(directory) if os.path.isdir(directory) else []
            lines = sum(capture_format.count_complete(m)[0]
                        for m in capture_format.manifest_files(directory)) \
                if os.path.isdir(directory) else 0
            killed = code == -signal.SIGKILL
            ok, note = analysis_reports_unfinished(root, directory,
                                                   os.path.join(root, "analysis"), killed)
            counts["runs"] += 1
            counts["kills during training"] += int(during)
            counts["manifests valid"] += int(not problems)
            counts["analysis ok"] += int(ok)
            print(f"run {run + 1:3d}: killed at {killed_at:6.2f} s "
                  f"({'during training' if during else 'before training'}), {lines} manifest "
                  f"lines, manifest {'valid' if not problems else 'INVALID: ' + problems[0]}, "
                  f"analysis {'ok' if ok else 'FAILED'} ({note})", flush=True)
    finally:
        if args.out is None:
            shutil.rmtree(base, ignore_errors=True)
    print(" | ".join(f"{name}: {value}" for name, value in counts.items()))
    return 0 if counts["manifests valid"] == counts["analysis ok"] == counts["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
