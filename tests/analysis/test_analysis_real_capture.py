"""The visualiser on a capture, log and TensorBoard events made by a real tiny training run."""

import os

import pytest

from conftest import TINY_MOCK_ARGS
from megatron.analysis.cli import main
from megatron.analysis.losses import parse_log_text
from megatron.analysis.statistics import load_json
from test_analysis_statistics import _check, _load_groups, _reference


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    import pretrain_gpt
    from megatron.training.training import pretrain

    root = tmp_path_factory.mktemp("real")
    capture, tb = str(root / "capture"), str(root / "tb")
    argv = TINY_MOCK_ARGS + ["--quant-scheme", "FA_linear_mxfp8", "--save-tensors",
                             "--tensor-save-dir", capture, "--control-iter", "1",
                             "--train-iters", "3", "--tensorboard-dir", tb]
    result = pretrain(pretrain_gpt.forward_step, argv)
    assert result.exit_code == 0 and result.iteration == 1
    return capture, tb, result


def test_real_capture_statistics(tiny_run, tmp_path):
    capture, tb, result = tiny_run
    out = tmp_path / "out"
    code = main(["--tensor-dir", capture, "--output-dir", str(out), "--workers", "2",
                 "--loss-logs", f"FA_linear_mxfp8={tb}", "--no-progress",
                 "--log-level", "WARNING"])
    assert code == 0
    doc = load_json(os.path.join(out, "statistics.json"))
    assert list(doc["quant_types"]) == ["FA_linear_mxfp8"]
    assert doc["problems"] == [{"kind": "loss_baseline_missing", "level": "warning",
                                "message": doc["problems"][0]["message"]}]
    assert doc["consistency"]["records_mismatched"] == 0
    section = doc["quant_types"]["FA_linear_mxfp8"]
    assert section["capture"]["manifest_records"] == section["overall"]["records"] > 0
    assert section["quantized"]["quantization"]["scale_exponent"] is not None
    records = _load_groups(capture, doc)
    ref, quant_ref = _reference([r for recs in records.values() for r in recs])
    _check(section["overall"], ref, quant_ref)
    assert doc["losses"]["table"][0]["final_loss"] == pytest.approx(result.losses[1], rel=1e-6)
    for name in ("report.html", "statistics.txt", "figures/value_distributions.png",
                 "figures/error_heatmap_FA_linear_mxfp8.png", "figures/loss_curves.png"):
        assert os.path.exists(out / name)


def test_real_log_text(capsys):
    import pretrain_gpt
    from megatron.training.training import pretrain

    result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + [
        "--train-iters", "2", "--lr-warmup-iters", "1", "--eval-interval", "2"])
    curve = parse_log_text(capsys.readouterr().out)
    assert set(curve.train) == {1, 2}
    for it, loss in result.losses.items():
        assert curve.train[it] == pytest.approx(loss, rel=1e-6)
    assert set(curve.valid) == {2}
    assert curve.valid[2] == pytest.approx(result.val_losses[2], rel=1e-6)


def test_load_frame_has_one_row_per_record_of_a_real_capture(tiny_run):
    from megatron.analysis import load_frame, load_tensors
    from megatron.tensor_capture.load import read_manifest

    capture, _, _ = tiny_run
    entries = read_manifest(os.path.join(capture, "FA_linear_mxfp8"))
    frame = load_frame(capture)
    assert len(frame) == len(entries) > 50
    assert set(frame["scheme"]) == {"FA_linear_mxfp8"} and set(frame["iteration"]) == {1}
    quantized = frame[frame["format"] != "none"]
    loaded = load_tensors(quantized.iloc[:1])[0]
    hp, q = loaded["hp"], loaded["quantized"]
    assert hp.shape == q.shape and not (hp == q).all()
