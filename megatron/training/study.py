"""Multi-seed scheme studies (`tools/study.py`, `make study`): is format X worse than bf16?

Trains every scheme at every seed with the same budget, collects the final validation
losses and writes DIR/study.json (schema in docs/experiments.md), DIR/study.png (loss curves
with a band over seeds), DIR/study.md (the table) and DIR/study.html. A seed fixes the
initialisation and the data order, so all runs of one seed see the same batches and the
gaps are paired by seed (megatron/analysis/study.py has the statistics).

Runs go to DIR/runs/{scheme}/seed{S}/ (train.log, result.json). A run whose result.json
says "done" for the same command is reused when the study is invoked again, so a study can
be extended with schemes or seeds, or resumed after an interruption. At most as many
trainings run at once as the machine has cores (--jobs), each with cores/jobs threads.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from megatron.analysis import study as study_stats
from megatron.analysis.losses import parse_log_text
from megatron.quantization.config import SCHEMES
from megatron.training import corpora
from megatron.training.bpe_tokenizer import DEFAULT_VOCAB_SIZE
from megatron.training import run_lock
from megatron.training.errors import ConfigError
from megatron.training.experiments.commands import split_extra

DEFAULT_SCHEMES = ("bf16", "FA_linear_mxfp8", "FA_linear_mxfp4", "FA_linear_hifp8",
                   "FA_linear_hifp8_scaled=FA_linear_hifp8 --hifp8-scaling tensor",
                   "linear_mxfp4", "linear_mxfp8")
STUDY_VERSION = 1
# The default CPU budget: 400 x 4 x 256 = 409,600 tokens per run; the default study (7 arms x
# 3 seeds) then takes about 40 minutes on 2 cores and brings bf16 from the unigram entropy of
# the 8k-BPE Wikipedia data (7.18 nats) to about 6.
DEFAULT_TRAIN_ITERS = 400


@dataclass(frozen=True)
class SchemeSpec:
    """A study arm: a label, the --quant-scheme and extra pretrain_gpt.py flags."""

    label: str
    scheme: str
    flags: Tuple[str, ...] = ()


def parse_scheme_spec(spec: str) -> SchemeSpec:
    """'FA_linear_mxfp8' or 'LABEL=SCHEME --flag value ...'."""
    label, sep, rest = spec.partition("=")
    parts = shlex.split(rest if sep else spec)
    label = label.strip() if sep else parts[0] if parts else ""
    if not parts or parts[0] not in SCHEMES:
        raise ValueError(f"--schemes {spec!r}: {parts[0] if parts else '(empty)'!r} is not a "
                         f"scheme; valid: {', '.join(SCHEMES)} (or LABEL=SCHEME --flags ...)")
    if not label or "/" in label or label.startswith("."):
        raise ValueError(f"--schemes {spec!r}: the label must be a plain name")
    return SchemeSpec(label, parts[0], tuple(parts[1:]))


@dataclass
class Run:
    spec: SchemeSpec
    seed: int
    directory: Path
    argv: List[str]
    result: dict = field(default_factory=dict)

    @property
    def key(self) -> str:
        """Identifies the command (its flags, not its paths): a changed command reruns."""
        text = json.dumps([a for a in self.argv if str(self.directory) not in a])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def log(self) -> Path:
        return self.directory / "train.log"

    @property
    def result_file(self) -> Path:
        return self.directory / "result.json"

    def finished(self) -> bool:
        try:
            saved = json.loads(self.result_file.read_text())
        except (OSError, ValueError):
            return False
        if saved.get("status") == "done" and saved.get("key") == self.key:
            self.result = saved
            return True
        return False


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="study.py", allow_abbrev=False,
        description="Train schemes x seeds at one budget and compare their final validation "
                    "losses with paired 95%% intervals. Flags after -- go to every "
                    "pretrain_gpt.py run.")
    p.add_argument("--output-dir", default="runs/study",
                   help="Where runs, study.json, study.png/.md/.html go (default: %(default)s).")
    p.add_argument("--schemes", nargs="+", default=list(DEFAULT_SCHEMES),
                   help="Study arms: scheme names, or LABEL=SCHEME --flags (e.g. "
                        "'hifp8_scaled=FA_linear_hifp8 --hifp8-scaling tensor'). The first is "
                        "the baseline unless --baseline is given. Default: %(default)s.")
    p.add_argument("--baseline", default=None, help="Label of the baseline arm (default: the "
                                                    "first of --schemes).")
    p.add_argument("--seeds", type=int, default=3,
                   help="Seeds per scheme (default: %(default)s; at least 2 for an interval, "
                        "3 or more for a useful one).")
    p.add_argument("--first-seed", type=int, default=1,
                   help="Seeds are first-seed, first-seed + 1, ... (default: %(default)s).")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--train-iters", type=int, default=None,
                        help="Iterations per run.")
    budget.add_argument("--tokens", type=int, default=None,
                        help="Tokens per run (rounded up to whole iterations). Default: "
                             f"{DEFAULT_TRAIN_ITERS} iterations.")
    p.add_argument("--model-preset", default="llama-tiny", help="Model (default: %(default)s).")
    p.add_argument("--dataset", default="wikipedia", choices=corpora.EMBEDDED_DATASETS,
                   help="Embedded dataset (default: %(default)s); built if missing.")
    p.add_argument("--tokenizer", default=f"bpe{DEFAULT_VOCAB_SIZE}",
                   help="bpeV: a V-entry BPE trained on the dataset (fast on a CPU; built if "
                        "missing), or llama3: the real Llama 3 tokenizer (default: "
                        "%(default)s).")
    p.add_argument("--data-root", default=str(corpora.DEFAULT_DATA_ROOT),
                   help="Data root (default: %(default)s).")
    p.add_argument("--data-path", nargs="+", default=None,
                   help="Your own preprocessed data (PREFIX or W1 PREFIX1 W2 PREFIX2 ..., "
                        "Llama 3 tokens) instead of --dataset; with --tokenizer llama3.")
    p.add_argument("--launcher", default=None,
                   help="Command that starts each training, e.g. 'torchrun --standalone "
                        "--nproc-per-node 8' on a GPU node (default: this Python, one "
                        "process; with a launcher --jobs defaults to 1).")
    p.add_argument("--seq-length", type=int, default=256,
                   help="Tokens per sample (default: %(default)s).")
    p.add_argument("--micro-batch-size", type=int, default=4,
                   help="Samples per micro-batch (default: %(default)s).")
    p.add_argument("--global-batch-size", type=int, default=4,
                   help="Samples per iteration (default: %(default)s).")
    p.add_argument("--lr", type=float, default=2e-3,
                   help="Peak learning rate (default: %(default)s).")
    p.add_argument("--min-lr", type=float, default=2e-4,
                   help="Learning rate at the end of the cosine decay (default: %(default)s).")
    p.add_argument("--warmup-fraction", type=float, default=0.1,
                   help="Linear warm-up over this fraction of the iterations, then cosine "
                        "decay to --min-lr.")
    p.add_argument("--evals", type=int, default=5,
                   help="Validation passes per run, evenly spaced; the last at the end.")
    p.add_argument("--eval-iters", type=int, default=18,
                   help="Batches per validation pass (default: %(default)s, about the whole "
                        "2%% validation split of the embedded Wikipedia data at the defaults).")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="Training precision of every run (default: %(default)s).")
    p.add_argument("--jobs", type=int, default=None,
                   help="Trainings at once (default and maximum: the machine's cores).")
    p.add_argument("--pretrain-script", default="pretrain_gpt.py",
                   help="The training entry point (default: %(default)s in the working "
                        "directory; tools/study.py passes the checkout's).")
    p.add_argument("--dry-run", action="store_true",
                   help="Print the commands and exit.")
    return p


def resolve_data(args) -> Tuple[List[str], str]:
    """(data and tokenizer flags, tokenizer description), building the data if needed."""
    if args.data_path:
        if args.tokenizer != "llama3":
            raise ValueError("--data-path: your own data is tokenized with Llama 3 (pass "
                             "--tokenizer llama3), or pass its tokenizer after '--'")
        return ["--data-path", *args.data_path, "--tokenizer-type", "Llama3Tokenizer"], \
            "Llama 3 (128,256)"
    if args.tokenizer == "llama3":
        prefix = corpora.ensure_embedded_dataset(args.dataset, args.data_root)
        return ["--data-path", prefix, "--tokenizer-type", "Llama3Tokenizer"], "Llama 3 (128,256)"
    if not args.tokenizer.startswith("bpe") or not args.tokenizer[3:].isdigit():
        raise ValueError(f"--tokenizer {args.tokenizer!r}: expected llama3 or bpeV (e.g. "
                         f"bpe{DEFAULT_VOCAB_SIZE})")
    vocab = int(args.tokenizer[3:])
    prefix, tokenizer = corpora.ensure_bpe_dataset(args.dataset, vocab, args.data_root)
    return (["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", tokenizer], f"byte-level BPE {vocab} trained on {args.dataset}")


def train_iters_of(args) -> int:
    per_iter = args.global_batch_size * args.seq_length
    if args.train_iters is not None:
        return args.train_iters
    if args.tokens is not None:
        return max(1, math.ceil(args.tokens / per_iter))
    return DEFAULT_TRAIN_ITERS


def common_flags(args, iters: int, data_flags: List[str]) -> List[str]:
    eval_interval = max(1, iters // max(1, args.evals))
    flags = ["--model-preset", args.model_preset, *data_flags, "--split", "98,2,0",
             "--seq-length", str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.global_batch_size), "--train-iters", str(iters),
             "--lr", str(args.lr), "--min-lr", str(args.min_lr), "--lr-decay-style", "cosine",
             "--lr-decay-iters", str(iters),
             "--lr-warmup-iters", str(max(1, round(args.warmup_fraction * iters))),
             "--log-interval", str(max(1, iters // 100)), "--eval-interval", str(eval_interval),
             "--eval-iters", str(args.eval_iters), "--num-workers", "0"]
    return flags + (["--bf16"] if args.precision == "bf16" else [])


def plan_runs(args, specs: List[SchemeSpec], flags: List[str], extra: List[str],
              out: Path) -> List[Run]:
    launcher = shlex.split(args.launcher) if args.launcher else [sys.executable]
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for spec in specs:        # seed-major: every scheme of a seed before the next seed
            directory = out / "runs" / spec.label / f"seed{seed}"
            argv = [*launcher, args.pretrain_script, *flags,
                    "--quant-scheme", spec.scheme, *spec.flags, "--seed", str(seed),
                    "--tensorboard-dir", str(directory / "tensorboard"),
                    "--data-cache-path", str(directory / "data-cache"), *extra]
            runs.append(Run(spec, seed, directory, argv))
    return runs


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------


def _start(run: Run, threads: int) -> subprocess.Popen:
    run.directory.mkdir(parents=True, exist_ok=True)
    (run.directory / "command.sh").write_text(shlex.join(run.argv) + "\n")
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    log = open(run.log, "w")
    proc = subprocess.Popen(run.argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    log.close()
    return proc


def _finish(run: Run, returncode: int, seconds: float) -> dict:
    curve = parse_log_text(run.log.read_text(errors="replace"), run.spec.label, str(run.log))
    last_val = curve.valid[max(curve.valid)] if curve.valid else None
    status = "done" if returncode == 0 and last_val is not None else "failed"
    result = {"scheme": run.spec.label, "quant_scheme": run.spec.scheme, "seed": run.seed,
              "final_val_loss": last_val,
              "final_iteration": max(curve.valid) if curve.valid else None,
              "log": str(run.log), "status": status, "returncode": returncode,
              "seconds": round(seconds, 1), "key": run.key,
              "train_loss": {str(k): v for k, v in sorted(curve.train.items())},
              "val_loss": {str(k): v for k, v in sorted(curve.valid.items())}}
    tmp = run.result_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, run.result_file)
    run.result = result
    return result


def _eta(done_seconds: List[float], remaining: int, jobs: int) -> str:
    if not done_seconds or remaining <= 0:
        return ""
    seconds = sum(done_seconds) / len(done_seconds) * math.ceil(remaining / jobs)
    return f"; ETA {seconds / 60:.0f} min" if seconds >= 90 else f"; ETA {seconds:.0f} s"


class StudyStopped(Exception):
    """SIGTERM (or Ctrl-C) reached the study: its trainings were ended."""


def _raise_stopped(signum, _frame):
    raise StudyStopped(signal.Signals(signum).name)


def _end(procs, grace: float = 10.0) -> None:
    """Terminate the running trainings and wait for them (kill what outlives `grace`), so that
    no orphan keeps writing into a run directory a restarted study will reuse."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.time() + grace
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def execute(runs: List[Run], jobs: int, threads: int, log=print) -> None:
    """Run what is not finished yet, `jobs` at a time, reporting progress. SIGTERM and Ctrl-C
    end the running trainings (their runs are redone by the next invocation) and raise
    StudyStopped."""
    todo = [r for r in runs if not r.finished()]
    reused = len(runs) - len(todo)
    if reused:
        log(f"[study] reusing {reused} finished run(s)")
    total, done, durations = len(todo), 0, []
    active: Dict[subprocess.Popen, Tuple[Run, float]] = {}
    start = time.time()
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        while todo or active:
            while todo and len(active) < jobs:
                run = todo.pop(0)
                log(f"[study] start {run.spec.label} seed {run.seed} -> {run.log}")
                active[_start(run, threads)] = (run, time.time())
            time.sleep(1.0)
            for proc in [p for p in active if p.poll() is not None]:
                run, t0 = active.pop(proc)
                result = _finish(run, proc.returncode, time.time() - t0)
                done += 1
                durations.append(result["seconds"])
                outcome = (f"val loss {result['final_val_loss']:.4f}"
                           if result["status"] == "done" else
                           f"FAILED (exit {proc.returncode}; see {run.log})")
                log(f"[study] run {done}/{total} {run.spec.label} seed {run.seed}: {outcome} "
                    f"({result['seconds']:.0f} s){_eta(durations, total - done, jobs)}")
    except (KeyboardInterrupt, StudyStopped) as exc:
        _end(list(active))
        interrupted = ", ".join(f"{run.spec.label} seed {run.seed}" for run, _ in active.values())
        raise StudyStopped(f"{type(exc).__name__ if isinstance(exc, KeyboardInterrupt) else exc}"
                           f" after {done} of {total} run(s); ended "
                           f"{interrupted or 'no running training'}") from None
    finally:
        signal.signal(signal.SIGTERM, previous)
    if total:
        log(f"[study] {total} run(s) in {(time.time() - start) / 60:.1f} min")


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def _bin_mean(curve: Dict[int, float], bins: int = 40) -> Dict[int, float]:
    """Training loss averaged over consecutive windows (the per-step loss is noisy)."""
    its = sorted(curve)
    if not its:
        return {}
    size = max(1, math.ceil(len(its) / bins))
    return {its[min(i + size, len(its)) - 1]: sum(curve[k] for k in its[i:i + size]) /
            len(its[i:i + size]) for i in range(0, len(its), size)}


def write_results(runs: List[Run], baseline: str, budget: dict, out: Path) -> dict:
    results = [r.result for r in runs if r.result]
    study = {
        "version": STUDY_VERSION,
        "baseline": baseline,
        "budget": budget,
        "runs": [{k: r[k] for k in ("scheme", "seed", "final_val_loss", "log", "status",
                                    "seconds")} for r in results],
        "schemes": study_stats.summarize(results, baseline),
    }
    val, train = {}, {}
    for r in results:
        if r["status"] != "done":
            continue
        val.setdefault(r["scheme"], {})[r["seed"]] = {int(k): v for k, v in r["val_loss"].items()}
        train.setdefault(r["scheme"], {})[r["seed"]] = _bin_mean(
            {int(k): v for k, v in r["train_loss"].items()})
    figure = study_stats.plot_curves(
        {"training loss (window mean)": train, "validation loss": val,
         f"validation loss vs {baseline}, same seed (%)":
             study_stats.relative_curves(val, baseline)},
        str(out / "study.png"), title=study_stats.describe_budget(study))
    tmp = out / ".study.json.tmp"
    tmp.write_text(json.dumps(study, indent=2) + "\n")
    os.replace(tmp, out / "study.json")
    table = study_stats.markdown_table(study)
    (out / "study.md").write_text(f"{study_stats.describe_budget(study)}\n\n{table}\n\n"
                                  f"{study_stats.noise_note(study)}\n")
    (out / "study.html").write_text(
        "<!doctype html><meta charset=\"utf-8\"><title>scheme study</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{border:1px solid #ccc;"
        "padding:4px 8px}table{border-collapse:collapse}</style>"
        + study_stats.html_section(study, os.path.basename(figure)))
    return study


def main(argv: Optional[Sequence[str]] = None) -> int:
    own, extra = split_extra(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    try:
        specs = [parse_scheme_spec(s) for s in args.schemes]
    except ValueError as exc:
        parser.error(str(exc))
    labels = [s.label for s in specs]
    if len(set(labels)) != len(labels):
        parser.error(f"--schemes: labels must be unique, got {', '.join(labels)}")
    baseline = args.baseline or labels[0]
    if baseline not in labels:
        parser.error(f"--baseline {baseline!r} is not one of --schemes ({', '.join(labels)})")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: must be >= 1")
    cores = os.cpu_count() or 1
    # A launcher (torchrun on GPUs) runs one training on the whole node at a time.
    jobs = min(args.jobs or (1 if args.launcher else cores), cores)
    if jobs < 1:
        parser.error(f"--jobs {args.jobs}: must be >= 1")
    if not os.path.isfile(args.pretrain_script):
        parser.error(f"--pretrain-script {args.pretrain_script}: no such file")
    iters = train_iters_of(args)
    lock = None
    if not args.dry_run:
        try:
            # One study per output directory: a second would rerun and overwrite its runs.
            lock = run_lock.acquire(args.output_dir, "--output-dir")
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 2
    try:
        data_flags, tokenizer = resolve_data(args)
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    out = Path(args.output_dir)
    runs = plan_runs(args, specs, common_flags(args, iters, data_flags), extra, out)
    budget = {"train_iters": iters, "tokens": iters * args.global_batch_size * args.seq_length,
              "model": args.model_preset, "tokenizer": tokenizer, "precision": args.precision,
              "seq_length": args.seq_length, "global_batch_size": args.global_batch_size,
              "lr": args.lr, "seeds": list(range(args.first_seed, args.first_seed + args.seeds))}
    if args.dry_run:
        for run in runs:
            print(shlex.join(run.argv))
        return 0
    log(f"[study] {len(specs)} scheme(s) x {args.seeds} seed(s) = {len(runs)} runs of "
        f"{iters} iterations ({budget['tokens']:,} tokens), {jobs} at once with "
        f"{max(1, cores // jobs)} thread(s) each -> {out}")
    if args.seeds < 3 or iters < 100:
        log(f"[study] caveat: {args.seeds} seed(s) of {iters} iterations: the intervals and "
            "verdicts of so small a study say little (use 3+ seeds and the default budget for "
            "a comparison)")
    try:
        execute(runs, jobs, max(1, cores // jobs), log)
    except StudyStopped as exc:
        log(f"[study] stopped by {exc}; finished runs are kept: run the same command again "
            f"to resume ({out})")
        lock.release()
        return 143
    study = write_results(runs, baseline, budget, out)
    lock.release()
    log("\n" + study_stats.markdown_table(study) + "\n\n" + study_stats.noise_note(study))
    log(f"[study] wrote {out / 'study.json'}, study.png, study.md, study.html")
    failed = [r for r in study["runs"] if r["status"] != "done"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
