"""One run, one scheme name: the report names runs by the label each run recorded (the
capture's run file, the training log's argument block), not by the names of the directories
and files it found them in. A TensorBoard directory `mxfp8` (train_config.py's bare format)
and the capture `FA_linear_mxfp8` of the same run are one scheme, not two half-empty ones."""

import os

import pytest

from megatron.analysis import synthetic
from megatron.analysis.cli import main
from megatron.analysis.statistics import load_json

ARGS = ["--no-figures", "--no-progress", "--workers", "1", "--log-level", "ERROR"]
SCHEME = "FA_linear_mxfp8"


def _log(path, label, tensorboard_dir, offset=0.0):
    """A training log as pretrain_gpt.py writes it: the argument block (the run's label as
    quant_config, its TensorBoard directory), then the iteration lines."""
    lines = ["------------------------ arguments ------------------------",
             f"  quant_config ........................... {label}",
             "  quant_scheme ........................... None",
             f"  tensorboard_dir ........................ {tensorboard_dir}",
             "-------------------- end of arguments ---------------------"]
    lines += [f" [2026-11-22 05:19:44] iteration {it:8d}/      30 | lm loss: "
              f"{7 - it / 10 + offset:.6E} |" for it in range(1, 31)]
    path.write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from torch.utils.tensorboard import SummaryWriter

    root = tmp_path_factory.mktemp("runs")
    synthetic.write_capture(str(root / "tensors"), ("bf16", SCHEME), layers=1, seq=8,
                            hidden=32, ffn=32, attention=False, modules=("linear_fc1",))
    # The user's names: the bare format for the quantized run (as train_config.py takes it).
    for name, label in (("bf16", "bf16"), ("mxfp8", SCHEME)):
        writer = SummaryWriter(log_dir=str(root / "tb" / name))
        for step in (10, 20, 30):
            writer.add_scalar("quant/L1.linear_fc1/fprop.input/amax", 3.0, step)
            if label != "bf16":
                for metric, value in (("sqnr_db", 30.0), ("saturated_pct", 0.5),
                                      ("flushed_pct", 0.0)):
                    writer.add_scalar(f"quant/L1.linear_fc1/fprop.input/{metric}", value, step)
        writer.close()
        (root / "logs").mkdir(exist_ok=True)
        _log(root / "logs" / f"{name}.log", label, root / "tb" / name,
             offset=0.01 if label != "bf16" else 0.0)
    return root


def _run(runs, tmp_path, *extra):
    out = str(tmp_path / "out")
    assert main(["--tensor-dir", str(runs / "tensors"), "--output-dir", out] + ARGS
                + list(extra)) == 0
    return load_json(os.path.join(out, "statistics.json"))


def _names(doc):
    """The scheme names of each part of the report, in the order it lists them."""
    return {"summary": [row[0] for row in doc["summary"]["rows"]],
            "telemetry": list((doc["telemetry"] or {}).get("schemes") or {}),
            "losses": [row["run"] for row in (doc["losses"] or {}).get("table") or []],
            "provenance": doc["provenance"]["schemes"]}


# The report lists schemes by name, character by character (capitals before lower case);
# the loss table lists runs in the order their logs were found (bf16.log, mxfp8.log).
BOTH = [SCHEME, "bf16"]
BY_LOG = ["bf16", SCHEME]


def test_runs_found_under_other_names_are_one_scheme_each(runs, tmp_path):
    doc = _run(runs, tmp_path, "--loss-dir", str(runs / "logs"), "--tensorboard-dir",
               str(runs / "tb"))
    assert _names(doc) == {"summary": BOTH, "telemetry": BOTH, "losses": BY_LOG,
                           "provenance": BOTH}
    gap = next(row for row in doc["summary"]["rows"] if row[0] == SCHEME)[-1]
    assert gap and "spread" in gap            # its loss gap sits in its own row
    assert doc["problems"] == []


def test_a_telemetry_run_that_matches_nothing_is_a_problem_with_its_fix(runs, tmp_path):
    doc = _run(runs, tmp_path, "--tensorboard-dir", str(runs / "tb"))
    (message,) = [p["message"] for p in doc["problems"] if p["kind"] == "unmatched_run_name"]
    assert "'mxfp8'" in message and SCHEME in message
    assert f"--tensorboard-dir {SCHEME}={runs / 'tb' / 'mxfp8'}" in message


def test_a_telemetry_directory_can_be_named(runs, tmp_path):
    doc = _run(runs, tmp_path, "--tensorboard-dir", str(runs / "tb" / "bf16"),
               f"{SCHEME}={runs / 'tb' / 'mxfp8'}")
    assert _names(doc)["telemetry"] == BOTH
    assert doc["problems"] == []


def test_an_explicit_loss_log_name_is_kept(runs, tmp_path):
    doc = _run(runs, tmp_path, "--loss-logs", f"bf16={runs / 'logs' / 'bf16.log'}",
               f"floor-run={runs / 'logs' / 'mxfp8.log'}")
    assert _names(doc)["losses"] == ["bf16", "floor-run"]


def _curve(name, label):
    from megatron.analysis.losses import LossCurve

    return LossCurve(name, f"{name}.log", args={"quant_config": label} if label else {})


@pytest.mark.parametrize("found,named", [
    # a log named after the bare recipe takes the label its run recorded
    ([("nvfp4", "recipe_nvfp4"), ("bf16", "bf16")], ["recipe_nvfp4", "bf16"]),
    # two runs of one scheme stay apart under their file names
    ([("seed1", SCHEME), ("seed2", SCHEME)], ["seed1", "seed2"]),
    # `d` keeps its name (no label), so `b` cannot take it, so `a` cannot take `b`
    ([("a", "b"), ("b", "d"), ("d", None)], ["a", "b", "d"]),
    # a swap is no clash: each label is free once its holder is renamed
    ([("a", "b"), ("b", "a")], ["b", "a"]),
])
def test_loss_runs_take_their_labels_unless_two_would_share_a_name(found, named):
    from megatron.analysis.losses import name_by_label

    curves = [_curve(name, label) for name, label in found]
    name_by_label(curves)
    assert [c.name for c in curves] == named
