"""Loss curves from training logs and TensorBoard event files, and their gaps to bf16."""

import math
import os

import pytest

from megatron.analysis import losses
from megatron.analysis.cli import main
from megatron.analysis.statistics import load_json

# Verbatim shape of the training loop's output (megatron/training/training.py), including a
# resumed run that logs iteration 2 again and a validation block framed by dashes.
LOG_BF16 = """\
[2026-11-22 05:19:40] training from iteration 0 to 5 (1 micro-batches of 4 per data-parallel rank, DP=1)
 [2026-11-22 05:19:44] iteration        1/       5 | consumed samples:            4 | elapsed time per iteration (ms): 1425.8 | throughput (tokens/s): 179.5 | learning rate: 1.500000E-03 | global batch size:     4 | lm loss: 7.008086E+00 | grad norm: 3.240 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-11-22 05:19:45] iteration        2/       5 | consumed samples:            8 | elapsed time per iteration (ms): 410.2 | throughput (tokens/s): 624.1 | learning rate: 3.000000E-03 | global batch size:     4 | lm loss: 6.950000E+00 | grad norm: 2.900 | number of skipped iterations:   0 | number of nan iterations:   0 |
[2026-11-22 05:19:46] resuming: loaded checkpoint (iteration 1)
 [2026-11-22 05:19:47] iteration        2/       5 | consumed samples:            8 | elapsed time per iteration (ms): 400.0 | throughput (tokens/s): 640.0 | learning rate: 3.000000E-03 | global batch size:     4 | lm loss: 6.940000E+00 | grad norm: 2.800 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-11-22 05:19:48] iteration        3/       5 | consumed samples:           12 | elapsed time per iteration (ms): 401.0 | throughput (tokens/s): 638.0 | learning rate: 2.700000E-03 | global batch size:     4 | lm loss: 6.900000E+00 | grad norm: 2.500 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-11-22 05:19:49] iteration        4/       5 | consumed samples:           16 | elapsed time per iteration (ms): 399.0 | throughput (tokens/s): 641.0 | learning rate: 2.000000E-03 | global batch size:     4 | lm loss: 6.850000E+00 | grad norm: 2.200 | number of skipped iterations:   0 | number of nan iterations:   0 |
 [2026-11-22 05:19:50] iteration        5/       5 | consumed samples:           20 | elapsed time per iteration (ms): 398.0 | throughput (tokens/s): 643.0 | learning rate: 1.000000E-03 | global batch size:     4 | lm loss: 6.800000E+00 | grad norm: 2.000 | number of skipped iterations:   0 | number of nan iterations:   0 |
---------------------------------------------------------------------------------------------
 validation loss at iteration 5 | lm loss value: 6.790351E+00 | lm loss PPL: 8.886455E+02 |
---------------------------------------------------------------------------------------------
"""


def _scaled_log(factor):
    """The same run with every loss multiplied by `factor` (another scheme)."""
    out = []
    for line in LOG_BF16.splitlines():
        for key in ("lm loss: ", "lm loss value: "):
            if key in line:
                head, tail = line.split(key, 1)
                value, rest = tail.split(" ", 1)
                line = f"{head}{key}{float(value) * factor:.6E} {rest}"
        out.append(line)
    return "\n".join(out) + "\n"


def test_parse_real_log_text():
    curve = losses.parse_log_text(LOG_BF16, "bf16")
    assert curve.train == {1: 7.008086, 2: 6.94, 3: 6.9, 4: 6.85, 5: 6.8}   # resumed 2 wins
    assert curve.valid == {5: 6.790351}


def test_tensorboard_event_files(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    for name, factor in (("bf16", 1.0), ("FA_linear_mxfp4", 1.02)):
        writer = SummaryWriter(log_dir=str(tmp_path / name))
        for it, value in losses.parse_log_text(LOG_BF16).train.items():
            writer.add_scalar("lm loss", value * factor, it)
            writer.add_scalar("learning-rate", 1e-3, it)
        writer.add_scalar("lm loss validation", 6.790351 * factor, 5)
        writer.close()
    curves = losses.load_curves([], [str(tmp_path)], problems=_Problems())
    by_name = {c.name: c for c in curves}
    assert set(by_name) == {"bf16", "FA_linear_mxfp4"}
    assert by_name["FA_linear_mxfp4"].train[5] == pytest.approx(6.8 * 1.02, rel=1e-6)
    assert by_name["bf16"].valid == {5: pytest.approx(6.790351, rel=1e-6)}
    table = {r["run"]: r for r in losses.loss_table(curves, "bf16")["table"]}
    # 5 logged iterations: the window is the last 3 (10% rounds up to 1, at least 3).
    window_mean = (6.9 + 6.85 + 6.8) / 3
    assert table["FA_linear_mxfp4"]["gap_window"] == [3, 5]
    assert table["FA_linear_mxfp4"]["gap_to_baseline"] == pytest.approx(window_mean * 0.02,
                                                                        rel=1e-5)
    assert table["FA_linear_mxfp4"]["relative_gap_to_baseline"] == pytest.approx(0.02, rel=1e-4)
    assert table["bf16"]["gap_to_baseline"] is None          # no gap of the baseline to itself


class _Problems:
    def __init__(self):
        self.items = []

    def add(self, kind, message, level="warning"):
        self.items.append({"kind": kind, "message": message})


def test_cli_with_loss_logs_only(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "bf16.log").write_text(LOG_BF16)
    (logs / "FA_linear_mxfp8.log").write_text(_scaled_log(1.001))
    extra = tmp_path / "hifp8_run.txt"
    extra.write_text(_scaled_log(1.05))
    out = tmp_path / "out"
    code = main(["--loss-dir", str(logs), "--loss-logs", f"FA_linear_hifp8={extra}",
                 "--output-dir", str(out), "--no-progress", "--log-level", "WARNING"])
    assert code == 0
    doc = load_json(os.path.join(out, "statistics.json"))
    table = {r["run"]: r for r in doc["losses"]["table"]}
    assert set(table) == {"bf16", "FA_linear_mxfp8", "FA_linear_hifp8"}
    assert doc["losses"]["baseline"] == "bf16"
    window = [6.9, 6.85, 6.8]                 # iterations 3..5 of the baseline
    mean = sum(window) / 3
    std = math.sqrt(sum((v - mean) ** 2 for v in window) / 2)
    mxfp8 = table["FA_linear_mxfp8"]
    assert mxfp8["final_loss"] == pytest.approx(6.8 * 1.001, rel=1e-6)
    assert mxfp8["gap_to_baseline"] == pytest.approx(mean * 0.001, rel=1e-4)
    # The scaled curve's spread is 1.001 times the baseline's: combined in quadrature.
    assert mxfp8["gap_spread"] == pytest.approx(std * math.hypot(1.0, 1.001), rel=1e-4)
    assert mxfp8["gap_within_noise"] is True
    assert mxfp8["gap_note"].startswith("within the curves' spread over the window")
    assert "seed-to-seed noise unknown" in mxfp8["gap_note"]
    hifp8 = table["FA_linear_hifp8"]
    assert hifp8["gap_to_baseline"] == pytest.approx(mean * 0.05, rel=1e-4)
    assert hifp8["gap_to_baseline"] > hifp8["gap_spread"] and not hifp8["gap_within_noise"]
    assert hifp8["validation_difference_to_baseline"] == pytest.approx(6.790351 * 0.05,
                                                                       rel=1e-4)
    assert hifp8["validation_compared_at_iteration"] == 5
    assert os.path.exists(out / "figures" / "loss_curves.png")
    html = (out / "report.html").read_text()
    text = (out / "statistics.txt").read_text()
    for page in (html, text):
        assert "Loss gap to bf16" in page and "seed-to-seed noise unknown" in page
        assert "run-to-run noise" not in page
    assert f"{mean * 1.001:.4g} ± {std * 1.001:.4g}" in text


def test_a_single_common_iteration_is_never_a_gap():
    base = losses.LossCurve("bf16", "", train={1: 7.0, 2: 6.5})
    other = losses.LossCurve("FA_linear_mxfp4", "", train={2: 6.7})
    row = {r["run"]: r for r in losses.loss_table([base, other], "bf16")["table"]}[
        "FA_linear_mxfp4"]
    assert row["gap_to_baseline"] is None and row["gap_window"] is None
    assert "1 common iteration(s): too few for a gap" in row["gap_note"]


def test_window_is_the_last_tenth_and_at_least_three():
    assert losses.last_window([1, 2]) == []
    assert losses.last_window(list(range(1, 6))) == [3, 4, 5]
    assert losses.last_window(list(range(1, 101))) == list(range(91, 101))
    assert losses.last_window(list(range(1, 42))) == list(range(37, 42))   # ceil(4.1) = 5


def test_demo_log_directory_uses_training_logs_not_capture_logs(tmp_path):
    """The demo writes {scheme}.log (training) and {scheme}-capture.log (one capture
    iteration) side by side; --loss-dir takes the former only."""
    for scheme, factor in (("bf16", 1.0), ("FA_linear_mxfp8", 1.001)):
        (tmp_path / f"{scheme}.log").write_text("  lr ...................... 0.003\n"
                                                + _scaled_log(factor))
        (tmp_path / f"{scheme}-capture.log").write_text(_scaled_log(factor))
    problems = _Problems()
    curves = losses.load_curves([], [str(tmp_path)], problems)
    assert sorted(c.name for c in curves) == ["FA_linear_mxfp8", "bf16"]
    assert problems.items == []
    assert all(c.source.endswith(f"{c.name}.log") for c in curves)
    assert all(c.args == {"lr": "0.003"} for c in curves)


def test_collection_log_directory_takes_only_the_run_logs(tmp_path):
    """run_tensor_collection.sh's log directory holds {scheme}.log, report.txt / report.tsv
    and tensorboard/{scheme}/ (the same runs again): --loss-dir takes the logs only."""
    from torch.utils.tensorboard import SummaryWriter

    for scheme, factor in (("bf16", 1.0), ("FA_linear_mxfp4", 1.02)):
        (tmp_path / f"{scheme}.log").write_text(_scaled_log(factor))
        writer = SummaryWriter(log_dir=str(tmp_path / "tensorboard" / scheme))
        writer.add_scalar("lm loss", 7.0 * factor, 1)
        writer.close()
    (tmp_path / "report.txt").write_text("scheme  status  records\nbf16  ok  464\n")
    (tmp_path / "report.tsv").write_text("scheme\tstatus\nbf16\tok\n")
    problems = _Problems()
    curves = losses.load_curves([], [str(tmp_path)], problems)
    assert sorted(c.name for c in curves) == ["FA_linear_mxfp4", "bf16"]
    assert problems.items == []
    # A run sub-directory (a log or event files inside) still counts.
    assert [name for name, _ in losses.sources_from_dir(str(tmp_path / "tensorboard"))] == [
        "FA_linear_mxfp4", "bf16"]


def test_unreadable_loss_sources(tmp_path, capsys):
    empty = tmp_path / "empty.log"
    empty.write_text("no losses here\n")
    code = main(["--loss-logs", f"x={empty}", f"y={tmp_path / 'missing.log'}",
                 "--output-dir", str(tmp_path / "out"), "--log-level", "ERROR"])
    assert code == 1
    assert capsys.readouterr().err.count("\n") == 1
