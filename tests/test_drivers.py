"""run_tensor_collection.sh and run_tensor_draw.sh: usage errors, dry runs, and one end-to-end
quick run on the CPU (tiny model, mock data, one captured iteration, then the visualiser)."""

import csv
import glob
import os
import shlex
import subprocess
import sys

import pytest

from megatron.training import experiments as ex
from megatron.training.arguments import parse_args, validate_args

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COLLECT = os.path.join(REPO_ROOT, "run_tensor_collection.sh")
DRAW = os.path.join(REPO_ROOT, "run_tensor_draw.sh")
VISUALIZER = os.path.join(REPO_ROOT, "tools", "visualization", "tensor_visualizer.py")


def run(script, *args, cwd=None, timeout=120):
    env = dict(os.environ, PYTHON=sys.executable)
    for var in ("TENSOR_SAVE_ENABLED", "TENSOR_SAVE_DIR", "CUSTOM_QUANT_TYPE", "WORLD_SIZE"):
        env.pop(var, None)
    return subprocess.run(["bash", script, *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


def one_error_line(proc, *expected):
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1, proc.stderr
    for text in expected:
        assert text in lines[0], lines[0]


class TestUsage:
    @pytest.mark.parametrize("script,words", [
        (COLLECT, ["single", "batch", "quick", "--control-iter", "--collect-micro-batches",
                   "--tensor-dir", "--nproc-per-node", "--quant-scheme", "--quant-type"]),
        (DRAW, ["collect", "visualize", "both", "--tensor-dir", "--output-dir",
                "--quant-scheme", "--quant-type"]),
    ])
    def test_help(self, script, words):
        proc = run(script, "--help")
        assert proc.returncode == 0
        for word in words:
            assert word in proc.stdout
        assert "set -euo" not in proc.stdout

    def test_bad_mode(self):
        one_error_line(run(COLLECT, "bogus"), "unknown mode 'bogus'", "single, batch, quick")
        one_error_line(run(COLLECT, "--mode", "fast"), "'fast'", "single, batch, quick")
        one_error_line(run(DRAW, "draw"), "unknown mode 'draw'", "visualize, collect, both")
        one_error_line(run(DRAW, "both", "--collect-mode", "all"), "'all'",
                       "single, batch, quick")

    def test_bad_quant_type(self):
        one_error_line(run(COLLECT, "single", "fp8"), "unknown quantization scheme 'fp8'",
                       "FA_linear_hifp8", "mxfp8")
        one_error_line(run(COLLECT, "batch", "--quant-scheme", "bf16,FA_fp4"), "'FA_fp4'")
        one_error_line(run(COLLECT, "batch", "--quant-type", "bf16,FA_fp4"), "'FA_fp4'")
        # run_tensor_draw.sh passes the collection's usage error through.
        proc = run(DRAW, "both", "FA_mxfp9")
        assert proc.returncode == 2 and "'FA_mxfp9'" in proc.stderr

    @pytest.mark.parametrize("args,expected", [
        (["single", "bf16", "--control-iter", "x"], ["--control-iter 'x'", "integer >= 0"]),
        (["single", "bf16", "--collect-micro-batches", "0"], ["integer >= 1"]),
        (["single", "bf16", "--tensor-dir"], ["--tensor-dir needs a value"]),
        (["single", "bf16", "--frobnicate"], ["unknown option '--frobnicate'"]),
        (["single", "bf16", "FA_mxfp8"], ["mode single collects one quant type", "batch"]),
    ])
    def test_bad_options(self, args, expected):
        one_error_line(run(COLLECT, *args), *expected)

    def test_bad_model_is_caught_before_running(self, tmp_path):
        proc = run(COLLECT, "single", "bf16", "--model", "gpt2", "--log-dir", str(tmp_path))
        one_error_line(proc, "unknown model 'gpt2'", "llama32-1b")
        assert not os.listdir(tmp_path)  # nothing started

    def test_bad_dataset(self, tmp_path):
        proc = run(COLLECT, "single", "bf16", "--dataset", "c4", "--log-dir", str(tmp_path))
        one_error_line(proc, "unknown dataset 'c4'", "wikipedia, dolma, mock")

    def test_visualize_rejects_collection_options(self):
        one_error_line(run(DRAW, "visualize", "FA_mxfp8"), "need mode collect or both")

    def test_visualize_missing_tensor_dir(self, tmp_path):
        proc = run(DRAW, "visualize", "--tensor-dir", str(tmp_path / "none"),
                   "--output-dir", str(tmp_path / "out"))
        assert proc.returncode == 1
        assert "not found" in proc.stderr or "not installed" in proc.stderr


def test_draw_output_defaults_under_runs(tmp_path):
    """Without --output-dir the report goes to runs/draw/<time>/ (ignored by git, like the
    collection logs under runs/), never to a ./draw/ beside the sources."""
    proc = run(DRAW, "visualize", "--tensor-dir", str(tmp_path), "--dry-run", cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    command = next(line for line in proc.stdout.splitlines() if "visualizing:" in line)
    argv = shlex.split(command.split("visualizing:", 1)[1])
    output = argv[argv.index("--output-dir") + 1]
    assert output.startswith("./runs/draw/") and len(output) > len("./runs/draw/"), output
    assert "runs/draw" in run(DRAW, "--help").stdout
    assert sorted(os.listdir(tmp_path)) == []


def test_batch_dry_run_commands_are_valid(tmp_path):
    """Dry runs print the exact commands; they parse and validate with the real parser."""
    proc = run(COLLECT, "batch", "bf16", "mxfp4", "--model", "llama32-1b", "--dataset", "dolma",
               "--control-iter", "2", "--collect-micro-batches", "3", "--tensor-dir",
               str(tmp_path / "t"), "--log-dir", str(tmp_path / "logs"), "--dry-run",
               "--", "--train-iters", "5")
    assert proc.returncode == 0, proc.stderr
    assert "quant type mxfp4 means FA_linear_mxfp4" in proc.stdout
    commands = [line for line in proc.stdout.splitlines() if line.startswith(("torchrun",
                                                                             "CUDA_"))]
    assert len(commands) == 2
    for line, scheme in zip(commands, ["bf16", "FA_linear_mxfp4"]):
        tokens = shlex.split(line)
        i = next(i for i, t in enumerate(tokens) if t.endswith("pretrain_gpt.py"))
        nproc = int(tokens[tokens.index("--nproc-per-node") + 1])
        args = parse_args(tokens[i + 1:])
        args.world_size, args.rank = nproc, 0
        validate_args(args, check_paths=False)
        assert args.quant_scheme == args.quant_config.scheme == scheme and args.save_tensors
        assert (args.control_iter, args.collect_micro_batches) == (2, 3)
        assert args.tensor_save_dir == str(tmp_path / "t")
        assert args.train_iters == 5 and args.save is None   # capture runs keep no checkpoints
        assert args.data_path == [ex.data_prefix("dolma")]
        assert args.tensorboard_dir == str(tmp_path / "logs" / "tensorboard" / scheme)
    assert not (tmp_path / "t").exists() and not (tmp_path / "logs").exists()


def test_dry_run_resolves_schemes_through_train_config(tmp_path):
    """--quant-scheme and its alias --quant-type; 'all' and bare formats become canonical names
    (train_config.py --print-schemes), each with its train_config.py and torchrun command."""
    common = ["--model", "llama-tiny", "--dataset", "mock", "--log-dir", str(tmp_path / "l"),
              "--dry-run"]
    proc = run(COLLECT, "batch", "--quant-scheme", "all", *common)
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stdout.splitlines() if line.startswith("[collect] [")]
    assert [line.split("]")[1].lstrip(" [") for line in runs] == list(ex.QUANT_SCHEMES)
    assert all("--quant-scheme " in line for line in runs)
    torchruns = [line for line in proc.stdout.splitlines() if line.startswith("torchrun")]
    assert len(torchruns) == len(ex.QUANT_SCHEMES)
    for line, scheme in zip(torchruns, ex.QUANT_SCHEMES):
        assert line.endswith(f"--quant-scheme {scheme} --save-tensors --tensor-save-dir "
                             "./enhanced_tensor_logs --control-iter 1 --collect-micro-batches 1")
    alias = run(COLLECT, "--mode", "single", "--quant-type", "hifp8", *common)
    primary = run(COLLECT, "--mode", "single", "--quant-scheme", "hifp8", *common)
    assert alias.returncode == primary.returncode == 0, alias.stderr + primary.stderr
    assert alias.stdout == primary.stdout
    assert "[collect] [FA_linear_hifp8]" in primary.stdout
    draw = run(DRAW, "collect", "--quant-type", "mxfp4", "--model", "llama-tiny",
               "--dataset", "mock", "--log-dir", str(tmp_path / "l"), "--dry-run")
    assert draw.returncode == 0, draw.stderr
    assert "--quant-scheme mxfp4" in draw.stdout and "[collect] [FA_linear_mxfp4]" in draw.stdout


def test_quick_end_to_end(tmp_path):
    """One short CPU run: collect (quick mode), report, then visualise (run_tensor_draw.sh both)."""
    tensors, draw, logs = tmp_path / "tensors", tmp_path / "draw", tmp_path / "logs"
    proc = run(DRAW, "both", "--collect-mode", "quick", "--quant-type", "FA_linear_mxfp8",
               "--tensor-dir", str(tensors), "--output-dir", str(draw), "--log-dir", str(logs),
               "--poll-interval", "2", "--quiet",
               "--", "--max-records", "40", "--workers", "1", "--no-progress", timeout=600)
    output = proc.stdout + proc.stderr
    # Collection: the run's log, the report and the records the manifests list.
    log = logs / "FA_linear_mxfp8.log"
    assert log.is_file(), output
    log_text = log.read_text()
    assert "[train_config] torchrun" in log_text and "--save-tensors" in log_text
    assert "iteration        1/" in log_text, log_text[-3000:]
    with open(logs / "report.tsv") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert [r["quant_type"] for r in rows] == ["FA_linear_mxfp8"]
    row = rows[0]
    assert row["exit"] == "0", output
    assert "tensor collection report" in proc.stdout and str(log) in proc.stdout
    manifests = glob.glob(str(tensors / "FA_linear_mxfp8" / "manifest-*.jsonl"))
    assert manifests, f"tensor capture wrote no manifest:\n{output[-3000:]}"
    lines = sum(1 for m in manifests for line in open(m) if line.strip())
    assert int(row["records"]) == lines > 0
    assert int(row["bytes"]) > 0 and row["status"] == "ok"
    assert "[collect] [FA_linear_mxfp8]" in proc.stdout and "records," in proc.stdout
    # The control-iter stop ended the run after the one captured iteration.
    assert "iteration        2/" not in log_text
    # Visualisation.
    assert os.path.isfile(VISUALIZER), "tools/visualization/tensor_visualizer.py is missing"
    assert proc.returncode == 0, output[-3000:]
    assert (draw / "report.html").is_file()
    assert f"[draw] report: {draw}/report.html" in proc.stdout
    assert list((logs / "tensorboard" / "FA_linear_mxfp8").glob("*tfevents*"))
    # The collection's training log became the report's loss curve.
    assert f"--loss-logs FA_linear_mxfp8={log}" in proc.stdout
