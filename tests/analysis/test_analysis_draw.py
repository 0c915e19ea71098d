"""run_tensor_draw.sh visualize: loss logs and telemetry without captures, and the flags it
passes to the visualiser."""

import os
import subprocess

from megatron.analysis.statistics import load_json
from test_analysis_losses import LOG_BF16, _scaled_log

from conftest import REPO_ROOT
DRAW = os.path.join(REPO_ROOT, "run_tensor_draw.sh")


def _draw(cwd, *args):
    return subprocess.run(["bash", DRAW, *args], cwd=str(cwd), capture_output=True, text=True,
                          timeout=300)


def _demo_logs(directory):
    """What the demo leaves in runs/demo/logs: a training and a capture log per scheme."""
    directory.mkdir()
    for scheme, factor in (("bf16", 1.0), ("FA_linear_mxfp8", 1.001)):
        (directory / f"{scheme}.log").write_text(_scaled_log(factor))
        (directory / f"{scheme}-capture.log").write_text(LOG_BF16.splitlines()[0] + "\n")


def test_visualize_compares_loss_logs_without_captures(tmp_path):
    _demo_logs(tmp_path / "logs")
    proc = _draw(tmp_path, "visualize", "--loss-dir", "logs", "--output-dir", "out", "--",
                 "--no-figures", "--workers", "1")
    assert proc.returncode == 0, proc.stderr
    assert "comparing the loss logs / telemetry only" in proc.stdout
    assert "--tensor-dir" not in proc.stdout.split("visualizing:")[1].splitlines()[0]
    doc = load_json(str(tmp_path / "out" / "statistics.json"))
    assert sorted(r["run"] for r in doc["losses"]["table"]) == ["FA_linear_mxfp8", "bf16"]
    assert doc["problems"] == []                      # no "no 'lm loss' values" for *-capture
    assert not (tmp_path / "out" / "records.csv").exists()


def test_dry_run_passes_the_sources_through(tmp_path):
    proc = _draw(tmp_path, "visualize", "--tensor-dir", "caps", "--loss-dir", "logs",
                 "--tensorboard-dir", "tb", "--loss-logs", "bf16=b.log", "--dry-run")
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.split("visualizing:")[1].splitlines()[0]
    for words in ("--tensor-dir caps", "--loss-dir logs", "--tensorboard-dir tb",
                  "--loss-logs bf16=b.log"):
        assert words in line


def test_an_explicit_missing_tensor_dir_is_still_an_error(tmp_path):
    _demo_logs(tmp_path / "logs")
    proc = _draw(tmp_path, "visualize", "--tensor-dir", "none", "--loss-dir", "logs",
                 "--output-dir", "out")
    assert proc.returncode == 1
    assert "tensor directory none not found" in proc.stderr
