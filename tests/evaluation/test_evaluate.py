"""tools/evaluate.py: direct-cast evaluation of one checkpoint under several arms.

The baseline loss is checked against pretrain_gpt.py's own validation of the same checkpoint
on the same batches; the intervals against a numpy/scipy computation from the per-sequence
sums; the sweep against an arm that quantizes the same single site through the ordinary flags.
"""

import json

import numpy as np
import pytest
from scipy import stats

import pretrain_gpt
from megatron.evaluation.cli import main as evaluate_main
from megatron.training.training import pretrain

from conftest import TINY_MOCK_ARGS, child_env

TRAIN = ["--train-iters", "3", "--eval-iters", "3", "--eval-interval", "1000", "--bf16"]
SR_ARM = "linear_nvfp4@quant-fprop=none,quant-stochastic-rounding=all"
RN_ARM = "linear_nvfp4@quant-fprop=none"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 3-iteration bf16 checkpoint and the validation loss pretrain_gpt.py logged for it."""
    ckpt = str(tmp_path_factory.mktemp("ckpt"))
    result = pretrain(pretrain_gpt.forward_step, TINY_MOCK_ARGS + TRAIN + ["--save", ckpt])
    return ckpt, result.val_losses[3]


def evaluate(ckpt, out, schemes, *extra):
    code = evaluate_main(["--load", ckpt, "--output-dir", str(out), "--schemes", *schemes,
                          *TINY_MOCK_ARGS, *TRAIN, *extra])
    assert code == 0
    with open(out / "evaluation.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def evaluated(trained, tmp_path_factory):
    ckpt, _ = trained
    out = tmp_path_factory.mktemp("eval")
    doc = evaluate(ckpt, out, ["bf16", "FA_linear_mxfp8", "linear_mxfp4", RN_ARM, SR_ARM,
                               "linear_mxfp4@quant-output-layer,quant-skip-layers=1+2"],
                   "--sweep", "sites", "--gradients", "--gradient-draws", "1", "4", "16",
                   "--dump-logits", str(out / "logits.npz"))
    return out, doc


def test_baseline_loss_is_pretrain_gpts_validation_loss(trained, evaluated):
    _, val_loss = trained
    _, doc = evaluated
    assert doc["baseline"] == "bf16"
    assert doc["schemes"]["bf16"]["loss"] == pytest.approx(val_loss, rel=1e-12, abs=0)
    # 3 eval iterations x global batch 4 sequences x 64 tokens, all scored (mock data).
    assert doc["tokens"] == 3 * 4 * 64 and doc["sequences"] == 12
    assert "delta_vs_baseline" not in doc["schemes"]["bf16"]


def test_paired_interval_is_the_t_interval_over_sequences(evaluated):
    out, doc = evaluated
    seq = np.load(out / "sequences.npz")
    labels = list(seq["labels"])
    tokens = seq["tokens"].astype(np.float64)
    assert (tokens == 64).all()
    base = seq["sums"][labels.index("bf16")]
    for label in ("FA_linear_mxfp8", "linear_mxfp4"):
        arm = seq["sums"][labels.index(label)]
        assert arm.sum() / tokens.sum() == pytest.approx(doc["schemes"][label]["loss"], rel=1e-6)
        # Equal tokens per sequence: the ordinary paired t interval of per-token differences.
        d = (arm - base) / tokens
        half = stats.t.ppf(0.975, d.size - 1) * d.std(ddof=1) / np.sqrt(d.size)
        got = doc["schemes"][label]["delta_vs_baseline"]
        assert got["mean"] == pytest.approx(d.mean(), rel=1e-9)
        assert got["ci95"] == pytest.approx([d.mean() - half, d.mean() + half], rel=1e-9)
        lo, hi = got["ci95_bootstrap"]
        assert lo < got["mean"] < hi
        # The losses sum each micro-batch in float32 (as training's validation does), the
        # per-sequence sums in float64: the two differences agree to float32 rounding.
        assert got["mean"] == pytest.approx(
            doc["schemes"][label]["loss"] - doc["schemes"]["bf16"]["loss"], abs=1e-6)
    # The expected ordering on fixed weights: MXFP4 costs more than MXFP8.
    assert doc["schemes"]["linear_mxfp4"]["delta_vs_baseline"]["mean"] > \
        doc["schemes"]["FA_linear_mxfp8"]["delta_vs_baseline"]["mean"]


def test_forward_of_backward_only_arms_is_the_baseline(evaluated):
    _, doc = evaluated
    for label in (RN_ARM, SR_ARM):
        assert doc["schemes"][label]["loss"] == doc["schemes"]["bf16"]["loss"]


def test_sweep_row_equals_the_same_site_quantized_by_flags(evaluated):
    _, doc = evaluated
    sweep = doc["sweep"]
    # 2 layers x (qkv, QK, PV, proj, fc1, fc2) + the output layer
    assert len(sweep["sites"]) == 13
    assert sorted(sweep["ranking"]) == sorted(
        f"{r['layer'] if r['layer'] is not None else '-'}/{r['site']}" for r in sweep["sites"])
    deltas = {f"{r['layer'] if r['layer'] is not None else '-'}/{r['site']}": r["delta"]["mean"]
              for r in sweep["sites"]}
    assert [deltas[k] for k in sweep["ranking"]] == sorted(deltas.values(), reverse=True)
    output = next(r for r in sweep["sites"] if r["site"] == "output")
    by_flags = doc["schemes"]["linear_mxfp4@quant-output-layer,quant-skip-layers=1+2"]
    assert output["loss"] == by_flags["loss"]
    assert output["delta"]["mean"] != 0


def test_gradient_fidelity(evaluated):
    _, doc = evaluated
    g = doc["gradients"]["schemes"]
    # bf16 is close to fp32; MXFP4 everywhere is far.
    assert g["bf16"]["vs_fp32"]["rel_l2"] < 0.05 < g["linear_mxfp4"]["vs_fp32"]["rel_l2"]
    assert g["bf16"]["vs_fp32"]["cosine"] > 0.999
    # Round-to-nearest is deterministic (no draws); the mean of 16 stochastic draws is much
    # nearer the fp32 gradient than one draw, and than round-to-nearest.
    assert "draws" not in g[RN_ARM]
    draws = g[SR_ARM]["draws"]
    assert draws["K"] == [1, 4, 16]
    assert draws["rel_l2"][0] == pytest.approx(g[SR_ARM]["vs_fp32"]["rel_l2"], rel=1e-12)
    assert draws["rel_l2"][2] < 0.6 * draws["rel_l2"][0]
    assert draws["rel_l2"][2] < g[RN_ARM]["vs_fp32"]["rel_l2"]
    assert "1/qkv" in g["linear_mxfp4"]["sites_vs_fp32"]


def test_logits_dump(evaluated):
    out, doc = evaluated
    dump = np.load(out / "logits.npz")
    assert dump["tokens"].dtype == np.int64 and dump["tokens"].shape == (2, 64)
    # NullTokenizer --vocab-size 512 has 513 entries (EOD); the padding beyond is cut off.
    assert dump["logits"].dtype == np.float32 and dump["logits"].shape == (2, 64, 513)
    assert np.isfinite(dump["logits"]).all()


def test_outputs(evaluated):
    out, _ = evaluated
    text = (out / "evaluation.md").read_text()
    assert "| FA_linear_mxfp8 |" in text and "Per-site sweep" in text
    for name in ("evaluation.png", "sweep.png", "gradients.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_same_numbers_twice_and_sr_reproducible_by_seed(trained, tmp_path):
    ckpt, _ = trained
    forward_sr = "linear_nvfp4@quant-stochastic-rounding=all"
    first = evaluate(ckpt, tmp_path / "a", ["bf16", forward_sr])
    second = evaluate(ckpt, tmp_path / "b", ["bf16", forward_sr])
    other_seed = evaluate(ckpt, tmp_path / "c", ["bf16", forward_sr], "--rounding-seed", "7")
    for doc in (first, second, other_seed):
        for arm in doc["schemes"].values():
            arm.pop("seconds")
        doc.pop("seconds")
        doc.pop("rounding_seed")
    assert first == second
    assert first["schemes"]["bf16"] == other_seed["schemes"]["bf16"]
    assert first["schemes"][forward_sr]["loss"] != other_seed["schemes"][forward_sr]["loss"]


FP8_ATTENTION = ("bf16@fp8-format=hybrid,fp8-recipe=tensorwise,fp8-dot-product-attention,"
                 "linear-quant=none")
CURRENT_ATTENTION = ("bf16@fp8-format=hybrid,fp8-recipe=tensorwise,attn-qk-quant=fp8_e4m3,"
                     "attn-pv-quant=fp8_e4m3,linear-quant=none")


def test_delayed_scales_start_from_the_first_micro_batch(trained, tmp_path):
    """FP8 attention quantizes P and dS with scales from amax histories, which an evaluation
    does not have: each arm first fills them from the first micro-batch, so that one is scaled
    from its own amaxes, as current scaling does (same formats, bit for bit), not with the
    initial scale 1.0 (which flushes most of dS). P's amax is 1 in every micro-batch (the first
    query sees only itself), so the losses equal current scaling's throughout; dS's history
    then lags one micro-batch, and the later gradients differ."""
    ckpt, _ = trained
    doc = evaluate(ckpt, tmp_path, ["bf16", FP8_ATTENTION, CURRENT_ATTENTION],
                   "--quant-attention-impl", "unfused", "--gradients",
                   "--gradient-micro-batches", "2")
    seqs = np.load(tmp_path / "sequences.npz")
    sums = dict(zip(seqs["labels"], seqs["sums"]))
    assert np.array_equal(sums[FP8_ATTENTION], sums[CURRENT_ATTENTION])
    assert not np.array_equal(sums[FP8_ATTENTION], sums["bf16"])
    rel = {arm: doc["gradients"]["schemes"][arm]["vs_fp32"]["per_micro_batch"]["rel_l2"]
           for arm in (FP8_ATTENTION, CURRENT_ATTENTION)}
    assert rel[FP8_ATTENTION][0] == rel[CURRENT_ATTENTION][0]
    assert rel[FP8_ATTENTION][1] != rel[CURRENT_ATTENTION][1]


@pytest.mark.parametrize("schemes, extra, expected", [
    (["bf16", "linear_mxfp9"], [], "'linear_mxfp9' is not a scheme"),
    (["bf16", "linear_mxfp8@mx-scale-mode=up"], [], "--schemes 'linear_mxfp8@mx-scale-mode"),
    (["bf16", "linear_mxfp8@no-such-flag"], [], "not a quantization flag: --no-such-flag"),
    (["bf16"], ["--quant-scheme", "linear_mxfp8"], "give the arms with --schemes"),
    (["bf16"], ["--quant-schedule", "high_precision@0.5"], "switches a training run's precision"),
    (["bf16", "linear_mxfp8@quant-schedule=high_precision@2"], [],
     "--schemes 'linear_mxfp8@quant-schedule=high_precision@2': --quant-schedule switches"),
    (["bf16"], ["--gradient-micro-batches", "0"], "--gradient-micro-batches 0"),
    (["bf16"], ["--eval-iters", "0"], "--eval-iters 0: must be >= 1"),
    (["bf16"], ["--vocab-size", "513"], "pass --vocab-size 512"),
])
def test_bad_input_is_one_line(trained, tmp_path, capsys, schemes, extra, expected):
    ckpt, _ = trained
    code = evaluate_main(["--load", ckpt, "--output-dir", str(tmp_path), "--schemes", *schemes,
                          *TINY_MOCK_ARGS, *TRAIN, *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("error: ") and expected in err and "\n" not in err


def test_a_directory_without_checkpoint_is_one_line(tmp_path, capsys):
    code = evaluate_main(["--load", str(tmp_path), "--output-dir", str(tmp_path / "o"),
                          "--schemes", "bf16", *TINY_MOCK_ARGS, *TRAIN])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "no checkpoint" in err and "\n" not in err


def test_a_missing_load_directory_is_one_line(tmp_path, capsys):
    """Without model flags a missing --load said '--num-layers is required'."""
    code = evaluate_main(["--load", str(tmp_path / "nope"), "--output-dir", str(tmp_path / "o"),
                          "--schemes", "bf16", "--mock-data"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "nope: no such directory" in err


def test_stochastic_rounding_draws_say_how_long(trained, tmp_path, capsys):
    """The draws of a stochastic-rounding arm print progress lines with the time left (before:
    'about 20 s left', then silence for the draws)."""
    ckpt, _ = trained
    evaluate(ckpt, tmp_path, ["bf16", SR_ARM], "--gradients", "--gradient-draws", "1", "2",
             "--eval-iters", "1", "--gradient-micro-batches", "1")
    out = capsys.readouterr().out
    assert f"{SR_ARM}: stochastic-rounding draw 1/2, about" in out


def test_load_hf_imports_once_and_dumps_transformers_logits(tmp_path, capsys):
    """--load-hf: the HF directory is imported into OUT/hf_checkpoint (reused the next time),
    and the dumped logits are transformers' own forward of the dumped tokens (fp32)."""
    import torch
    from test_convert_hf import TOKENIZER, _hf_config, _hf_logits, _hf_model

    model = _hf_model(_hf_config(tied=False), 5)
    model.save_pretrained(str(tmp_path / "hf"))
    argv = ["--load-hf", str(tmp_path / "hf"), "--output-dir", str(tmp_path / "out"),
            "--schemes", "bf16", "linear_mxfp4", "--mock-data", *TOKENIZER,
            "--seq-length", "128", "--micro-batch-size", "2", "--global-batch-size", "2",
            "--eval-iters", "1", "--dump-logits", str(tmp_path / "logits.npz")]
    assert evaluate_main(argv) == 0
    dump = np.load(tmp_path / "logits.npz")
    expected = _hf_logits(model, torch.from_numpy(dump["tokens"])).numpy()
    assert dump["logits"].shape == expected.shape
    scale = np.abs(expected).max()
    assert np.abs(dump["logits"] - expected).max() <= 1e-4 * scale
    assert "importing" in capsys.readouterr().out
    assert evaluate_main(argv) == 0
    assert "reusing" in capsys.readouterr().out


def test_two_data_parallel_ranks_give_the_single_process_numbers(trained, evaluated, tmp_path):
    """Under torchrun each rank evaluates its share of the sequences and rank 0 gathers them:
    the same sequences in the same micro-batches as one process, so the same numbers (to the
    summation order of threads: each rank runs one thread)."""
    import os
    import subprocess
    import sys

    from conftest import REPO_ROOT
    from test_distributed import _free_port

    ckpt, _ = trained
    _, single = evaluated
    out = tmp_path / "dp2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-port", str(_free_port()), os.path.join(REPO_ROOT, "tools", "evaluate.py"),
           "--load", ckpt, "--output-dir", str(out), "--schemes", "bf16", "linear_mxfp4",
           *TINY_MOCK_ARGS, *TRAIN]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=child_env(OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with open(out / "evaluation.json") as f:
        doc = json.load(f)
    assert doc["sequences"] == single["sequences"] and doc["tokens"] == single["tokens"]
    for label in ("bf16", "linear_mxfp4"):
        assert doc["schemes"][label]["loss"] == pytest.approx(single["schemes"][label]["loss"],
                                                             rel=1e-6)
    d2, d1 = (d["schemes"]["linear_mxfp4"]["delta_vs_baseline"] for d in (doc, single))
    assert d2["ci95"] == pytest.approx(d1["ci95"], rel=1e-3, abs=1e-7)


@pytest.mark.parametrize("spec", ["recipe_nvfp4@quant-recipe=nvfp4_4over6",
                                  "linear_mxfp8@quant-scheme=linear_nvfp4",
                                  "linear_mxfp8@--quant-recipe-file=recipe.yaml"])
def test_a_spec_cannot_name_another_arm_after_its_at(spec):
    # The spec is the arm's label: a scheme or recipe after '@' would evaluate another arm.
    from megatron.evaluation.specs import split_spec
    from megatron.training.errors import ConfigError
    with pytest.raises(ConfigError, match="is what the spec's name says"):
        split_spec(spec)


def test_a_spec_gives_a_switch_true_or_false():
    from megatron.evaluation.specs import arm_config, split_spec
    from megatron.quantization.config import QuantSettings
    from megatron.training.errors import ConfigError
    assert split_spec("linear_nvfp4@nvfp4-row-scaled-activation=true")[1] == \
        ["--quant-scheme", "linear_nvfp4", "--nvfp4-row-scaled-activation"]
    assert split_spec("linear_mxfp8@quant-weight-cache=false")[1] == \
        ["--quant-scheme", "linear_mxfp8", "--no-quant-weight-cache"]
    config = arm_config("linear_nvfp4@nvfp4-row-scaled-activation=true", QuantSettings(), 2, 0)
    assert config.linear.nvfp4.row_scaled_activation
    with pytest.raises(ConfigError, match="is a switch that is off unless given"):
        split_spec("linear_nvfp4@nvfp4-row-scaled-activation=false")
    with pytest.raises(ConfigError, match="is a switch: it takes no value, true or false, not "
                                          "'yes'"):
        split_spec("linear_mxfp8@quant-weight-cache=yes")
