"""FP4/FP8 recipes as flags and files: what each resolves to, and every mistake one line."""

import json
import os

import pytest

from megatron.quantization.config import OperandFormats, SettingError
from megatron.quantization.describe import describe_config
from megatron.quantization.presets import nvfp4_bf16_layers_at_end
from megatron.quantization.recipes import global_module_path
from megatron.training.arguments import ConfigError, parse_args, validate_args

from conftest import TINY_MOCK_ARGS


def quant(extra, num_layers=8):
    args = parse_args(TINY_MOCK_ARGS + ["--train-iters", "2", "--num-layers", str(num_layers)]
                      + extra)
    args.world_size = 1
    return validate_args(args, check_paths=False).quant_config


def error(extra, num_layers=8) -> str:
    with pytest.raises(ConfigError) as info:
        quant(extra, num_layers)
    message = str(info.value)
    assert "\n" not in message
    return message


# ---------------------------------------------------------------------------------------------
# Named recipes
# ---------------------------------------------------------------------------------------------

def test_nvfp4_recipe_is_the_papers_setting():
    q = quant(["--quant-recipe", "nvfp4"], num_layers=8)
    lin = q.linear
    for gemm in ("fprop", "dgrad", "wgrad"):
        assert getattr(lin, gemm) == OperandFormats("nvfp4", "nvfp4")
    assert lin.weight_2d and lin.rht.gemms == ("wgrad",) and lin.rht.block == 16
    assert lin.stochastic == {"dgrad.a", "wgrad.b"}          # the dY operands only
    assert lin.rht.seed == 1234                                # --seed
    assert not q.attn_qk.enabled and not q.attn_pv.enabled    # attention in BF16
    assert q.skip_layers == {8}                                # round(0.15 * 8) = 1
    assert q.recipe == "nvfp4"
    assert "recipe: nvfp4" in describe_config(q, 8)


@pytest.mark.parametrize("layers,tail", [(1, 1), (4, 1), (8, 1), (16, 2), (32, 5), (62, 9)])
def test_nvfp4_bf16_tail_is_about_15_percent_and_at_least_one(layers, tail):
    assert nvfp4_bf16_layers_at_end(layers) == tail


def test_first_last_layers_bf16_replaces_the_recipe_tail():
    q = quant(["--quant-recipe", "nvfp4", "--first-last-layers-bf16",
               "--num-layers-at-start-in-bf16", "2", "--num-layers-at-end-in-bf16", "3"])
    assert q.skip_layers == {1, 2, 6, 7, 8}


def test_first_last_layers_bf16_defaults_are_megatrons():
    args = parse_args(TINY_MOCK_ARGS + ["--train-iters", "2"])
    assert (args.first_last_layers_bf16, args.num_layers_at_start_in_bf16,
            args.num_layers_at_end_in_bf16) == (False, 1, 1)
    q = quant(["--quant-scheme", "linear_mxfp8", "--first-last-layers-bf16"], num_layers=4)
    assert q.skip_layers == {1, 4}
    assert q.for_site("linear", 1).enabled is False and q.for_site("linear", 2).enabled


def test_mxfp4_rht_sr_recipe():
    lin = quant(["--quant-recipe", "mxfp4_rht_sr"]).linear
    assert lin.fprop == OperandFormats("none", "none")
    assert lin.dgrad == lin.wgrad == OperandFormats("mxfp4", "mxfp4")
    assert lin.rht.gemms == ("dgrad", "wgrad") and lin.rht.block == 64
    assert lin.stochastic == {"dgrad.a", "dgrad.b", "wgrad.a", "wgrad.b"}


def test_flags_without_a_recipe():
    lin = quant(["--quant-scheme", "linear_nvfp4", "--quant-stochastic-rounding", "all",
                 "--quant-rht", "32", "--quant-weight-2d"]).linear
    assert lin.stochastic == {"fprop.a", "fprop.b", "dgrad.a", "dgrad.b", "wgrad.a", "wgrad.b"}
    assert lin.rht.gemms == ("wgrad",) and lin.rht.block == 32 and lin.weight_2d
    lin = quant(["--quant-scheme", "linear_mxfp4", "--quant-rht", "64", "--quant-rht-gemms",
                 "dgrad", "wgrad"]).linear
    assert lin.rht.gemms == ("dgrad", "wgrad") and not lin.weight_2d and not lin.stochastic


@pytest.mark.parametrize("extra,expected", [
    (["--quant-recipe", "nvfp4", "--quant-scheme", "linear_mxfp8"], "drop --quant-scheme"),
    (["--quant-recipe", "nvfp4", "--quant-stochastic-rounding", "all"],
     "--quant-stochastic-rounding: the recipe sets these; drop it"),
    (["--quant-recipe", "nvfp4", "--linear-quant", "mxfp4"], "--linear-quant"),
    (["--quant-scheme", "linear_mxfp4", "--quant-rht-gemms", "wgrad"], "needs --quant-rht"),
    (["--quant-recipe", "nvfp4", "--first-last-layers-bf16", "--num-layers-at-end-in-bf16",
      "9"], "--num-layers-at-end-in-bf16 9: must be in 0..8"),
    (["--quant-scheme", "linear_nvfp4", "--quant-stochastic-rounding", "all",
      "--recompute-granularity", "full", "--recompute-method", "uniform"],
     "stochastic rounding of forward operands with --recompute-*"),
])
def test_recipe_mistakes_are_one_line(extra, expected):
    assert expected in error(extra)


# ---------------------------------------------------------------------------------------------
# FP8 flags (megatron-core's names)
# ---------------------------------------------------------------------------------------------

def test_fp8_format_implies_linear_fp8_with_megatron_defaults():
    q = quant(["--fp8-format", "hybrid"])
    assert q.scheme == "linear_fp8"
    lin = q.linear
    assert lin.fprop == OperandFormats("fp8_e4m3", "fp8_e4m3")
    assert lin.dgrad == OperandFormats("fp8_e5m2", "fp8_e4m3")       # (dY, W)
    assert lin.wgrad == OperandFormats("fp8_e4m3", "fp8_e5m2")       # (X, dY)
    assert (lin.fp8.scaling, lin.fp8.amax_history_len, lin.fp8.amax_compute_algo,
            lin.fp8.margin, lin.fp8.power_of_two) == ("delayed", 1, "most_recent", 0, False)
    assert not lin.weight_2d


def test_fp8_recipes():
    lin = quant(["--fp8-format", "e4m3", "--fp8-recipe", "tensorwise", "--fp8-margin", "1"]).linear
    assert lin.dgrad == OperandFormats("fp8_e4m3", "fp8_e4m3")
    assert lin.fp8.scaling == "tensorwise" and lin.fp8.margin == 1
    lin = quant(["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]).linear
    assert lin.fp8.scaling == "blockwise" and lin.fp8.power_of_two and lin.weight_2d
    lin = quant(["--fp8-format", "e4m3", "--fp8-recipe", "blockwise", "--no-fp8-power-2-scales",
                 "--no-quant-weight-2d"]).linear
    assert not lin.fp8.power_of_two and not lin.weight_2d
    lin = quant(["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--fp8-amax-history-len",
                 "16", "--fp8-amax-compute-algo", "max"]).linear
    assert (lin.fp8.amax_history_len, lin.fp8.amax_compute_algo) == (16, "max")


def test_fp8_mxfp8_recipe_is_the_mxfp8_path_with_tes_scale_rule():
    q = quant(["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"])
    same = quant(["--quant-scheme", "linear_mxfp8", "--mx-grad-format", "e5m2",
                  "--mx-scale-mode", "rceil"])
    assert q.scheme == "linear_mxfp8"
    # The site carries the run's FP8 settings (--fp8-format/--fp8-recipe as given); they act on
    # FP8 operands only, and an MXFP8 site has none: everything else is the same config.
    assert not any(f.startswith("fp8_") for f in q.linear.formats)
    assert q.linear.replace(fp8=same.linear.fp8) == same.linear
    assert q.linear.mx.scale_mode == "rceil" and q.linear.dgrad.a == "mxfp8_e5m2"


def test_fp8_attention_uses_current_scaling():
    q = quant(["--quant-scheme", "FA_linear_fp8", "--fp8-recipe", "delayed"])
    assert q.linear.fp8.scaling == "delayed" and q.attn_qk.fp8.scaling == "tensorwise"
    assert any("current (tensorwise) scaling" in note for note in q.notes)


@pytest.mark.parametrize("extra,expected", [
    (["--fp8-format", "e4m3", "--quant-scheme", "linear_mxfp4"],
     "--quant-scheme linear_mxfp4 puts them in mxfp4"),
    (["--fp8-format", "e4m3", "--quant-scheme", "FA_mxfp8"], "use --quant-scheme FA_linear_fp8"),
    (["--fp8-recipe", "delayed"], "--fp8-recipe delayed needs --fp8-format"),
    (["--fp8-format", "e4m3", "--fp8-amax-history-len", "0"], "--fp8-amax-history-len 0"),
    (["--fp8-format", "e4m3", "--recompute-activations"], "delayed FP8 scaling with --recompute"),
])
def test_fp8_mistakes_are_one_line(extra, expected):
    assert expected in error(extra)


@pytest.mark.parametrize("extra,expected", [
    (["--quant-scheme", "linear_mxfp8", "--quant-accumulation-bits", "13",
      "--quant-accumulation-gemms", "fprop", "wgrad", "fprop"],
     "--quant-accumulation-gemms fprop wgrad fprop: fprop given more than once"),
    (["--quant-scheme", "linear_mxfp4", "--quant-rht", "16", "--quant-rht-gemms", "wgrad",
      "wgrad"], "--quant-rht-gemms wgrad wgrad: wgrad given more than once"),
])
def test_a_list_setting_names_each_item_once(extra, expected):
    assert expected in error(extra)


def test_the_accumulator_on_a_run_without_quantized_gemms_is_a_note():
    note = "--quant-accumulation-bits 13 changes nothing here"
    assert any(note in n for n in quant(["--quant-accumulation-bits", "13"]).notes)
    assert not any(note in n for n in quant(["--quant-accumulation-bits", "13",
                                             "--quant-scheme", "linear_mxfp8"]).notes)


def test_an_mx_gradient_format_without_mxfp8_gradients_is_a_note():
    note = "--mx-grad-format e5m2 changes nothing here"
    for flags in (["--quant-recipe", "mxfp8_fwd_nvfp4_bwd"], ["--quant-scheme", "linear_nvfp4"]):
        assert any(note in n for n in quant(flags + ["--mx-grad-format", "e5m2"]).notes), flags
    assert not any(note in n for n in quant(["--quant-scheme", "linear_mxfp8",
                                             "--mx-grad-format", "e5m2"]).notes)


# ---------------------------------------------------------------------------------------------
# Recipe files
# ---------------------------------------------------------------------------------------------

RECIPE = """
configs:
  fp4:
    format: nvfp4
    weight_2d: true
    stochastic_rounding: grad
    wgrad: {format: nvfp4, rht: 16}
  fp8:
    format: fp8_e4m3
    grad_format: fp8_e5m2
    fp8_recipe: blockwise
  hp: {format: none}
matchers:
  last: {config: hp, type: glob, pattern: "decoder.layers.7.*", enabled: true}
  off: {config: fp8, type: glob, pattern: "*", enabled: false}
  fc2: {config: fp8, type: glob, pattern: "*linear_fc2", enabled: true}
  linear: {config: fp4, type: glob, pattern: "*linear_*", enabled: true}
"""


def write(tmp_path, text, name="recipe.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_recipe_file_resolves_per_module_path(tmp_path):
    q = quant(["--quant-recipe-file", write(tmp_path, RECIPE)])
    fp4 = q.rules.configs["fp4"]
    assert fp4.fprop == fp4.dgrad == fp4.wgrad == OperandFormats("nvfp4", "nvfp4")
    assert fp4.rht.gemms == ("wgrad",) and fp4.weight_2d
    assert fp4.stochastic == {"dgrad.a", "wgrad.b"}
    fp8 = q.rules.configs["fp8"]
    assert fp8.dgrad == OperandFormats("fp8_e5m2", "fp8_e4m3") and fp8.fp8.scaling == "blockwise"
    assert not q.for_site("linear", 8, "decoder.layers.7.mlp.linear_fc1").enabled
    assert q.for_site("linear", 2, "decoder.layers.1.mlp.linear_fc2") == fp8
    assert q.for_site("linear", 2, "decoder.layers.1.mlp.linear_fc1") == fp4
    # Unmatched sites keep the scheme's config (bf16 here: high precision).
    assert not q.for_site("attn_qk", 2, "decoder.layers.1.self_attention.core_attention.qk").enabled
    json_path = write(tmp_path, json.dumps({"configs": {"a": {"format": "mxfp6_e3m2"}},
                                            "matchers": {"m": {"config": "a", "type": "glob",
                                                               "pattern": "*", "enabled": True}}}),
                      "recipe.json")
    assert quant(["--quant-recipe-file", json_path]).rules.configs["a"].fprop.a == "mxfp6_e3m2"


def test_global_module_path_under_pipeline_parallelism():
    assert global_module_path("decoder.layers.0.mlp.linear_fc1", 5) == \
        "decoder.layers.4.mlp.linear_fc1"
    assert global_module_path("module.decoder.layers.1.self_attention.core_attention.qk", 2) \
        == "module.decoder.layers.1.self_attention.core_attention.qk"
    assert global_module_path("output_layer", None) == "output_layer"


@pytest.mark.parametrize("text,expected", [
    ("configs: {a: {format: nvfp5}}\nmatchers: {m: {config: a, type: glob, pattern: '*', "
     "enabled: true}}", "configs.a.format: unknown quantization format 'nvfp5'"),
    ("configs: {a: {formatt: nvfp4}}\nmatchers: {m: {config: a, type: glob, pattern: '*', "
     "enabled: true}}", "unknown key(s) formatt"),
    ("configs: {a: {wgrad: {format: nvfp4, rht: 24}}}\nmatchers: {m: {config: a, type: glob, "
     "pattern: '*', enabled: true}}", "configs.a.wgrad.rht: 24 is not one of 16, 32, 64, 128"),
    ("configs: {a: {format: nvfp4}}\nmatchers: {m: {config: b, type: glob, pattern: '*', "
     "enabled: true}}", "config 'b' is not defined under configs"),
    ("configs: {a: {format: nvfp4}}\nmatchers: {m: {config: a, type: regex, pattern: '*', "
     "enabled: true}}", "matcher m.type: 'regex' is not one of glob"),
    ("configs: {a: {format: nvfp4}}\nmatchers: {m: {config: a, type: glob, pattern: '*'}}",
     "every matcher is disabled"),
    ("configs: {a: {format: nvfp4}}\nmatchers: {m: {config: a, pattern: '*', enabled: true}}",
     "matcher m: missing 'type'"),
    ("configs: {a: {stochastic_rounding: some}}\nmatchers: {m: {config: a, type: glob, "
     "pattern: '*', enabled: true}}", "stochastic_rounding: 'some' is not one of none, grad, all"),
    ("configs: {a: {format: nvfp4}}\nmatchers: {}", "no matchers"),
    ("configs: [nvfp4]\nmatchers: {m: {config: a, type: glob, pattern: '*', enabled: true}}",
     "configs: expected a mapping, got list"),
    ("- a\n- b\n", "expected a mapping with 'configs' and 'matchers'"),
    ("configs: {a: [1\n", "not valid YAML"),
])
def test_recipe_file_mistakes_are_one_line(tmp_path, text, expected):
    assert expected in error(["--quant-recipe-file", write(tmp_path, text)])


def test_recipe_file_contradicting_flags(tmp_path):
    path = write(tmp_path, RECIPE)
    assert "--quant-recipe nvfp4 and --quant-recipe-file" in error(
        ["--quant-recipe", "nvfp4", "--quant-recipe-file", path])
    assert "with --quant-wgrad" in error(["--quant-recipe-file", path, "--quant-wgrad", "none"])
    assert "cannot read it" in error(["--quant-recipe-file", str(tmp_path / "missing.yaml")])


def test_the_run_is_labelled_by_what_chose_its_formats(tmp_path):
    """Capture directories, run files and reports use the run label (args.quant_config.label):
    the scheme the --fp8-* flags imply, or the recipe's name, never a bf16 that was not run."""
    def label(extra):
        args = parse_args(TINY_MOCK_ARGS + ["--train-iters", "2"] + extra)
        args.world_size = 1
        args = validate_args(args, check_paths=False)
        return args.quant_config.label, args.quant_config.source

    assert label(["--fp8-format", "hybrid"]) == ("linear_fp8", "--fp8-format")
    assert label(["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]) == ("linear_mxfp8",
                                                                          "--fp8-format")
    assert label(["--quant-recipe", "nvfp4"]) == ("recipe_nvfp4", "--quant-recipe")
    path = write(tmp_path, RECIPE)
    assert label(["--quant-recipe-file", path])[0] == "recipe_file"
    assert label(["--quant-scheme", "FA_mxfp8", "--quant-recipe-file", path]) == (
        "FA_mxfp8_recipe_file", "--quant-scheme and --quant-recipe-file")
    assert label(["--quant-scheme", "linear_mxfp4"]) == ("linear_mxfp4", "--quant-scheme")


def test_a_named_recipe_carries_the_runs_site_settings():
    """The recipe decides formats, rounding, transforms and tiles; the settings of the
    concerns every site carries (MX scale rule, HiFP8 and FP8 scaling, how the GEMMs compute)
    are the run's, as for any scheme."""
    from megatron.quantization.schemes import quant_config

    plain = quant_config(["--quant-recipe", "mxfp4_rht_sr"], num_layers=4).linear
    rceil = quant_config(["--quant-recipe", "mxfp4_rht_sr", "--mx-scale-mode", "rceil"],
                         num_layers=4).linear
    assert plain.mx.scale_mode == "floor" and rceil.mx.scale_mode == "rceil"
    assert rceil.replace(mx=plain.mx) == plain


def _recipe_error(tmp_path, text, name="recipe.yaml"):
    from megatron.quantization.schemes import quant_config

    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SettingError) as info:
        quant_config(["--quant-recipe-file", str(path)], num_layers=2)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"--quant-recipe-file {path}"), message
    return message


MATCHER = "matchers:\n  m: {config: c, type: glob, pattern: '*', enabled: true}\n"


def test_recipe_values_of_the_wrong_type_are_one_line(tmp_path):
    """Values YAML reads as another type than the setting's are refused at start-up, not at
    the first GEMM."""
    cases = {"fp8_margin: .nan": "fp8_margin", "fp8_margin: abc": "fp8_margin",
             "fp8_pow2_scale: 'no'": "fp8_pow2_scale",
             "fp8_amax_history_len: 1000000000": "fp8_amax_history_len",
             "wgrad: {format: nvfp4, rht: 16.0}": "wgrad.rht",
             "scale_mode: ceiling": "scale_mode"}
    for line, key in cases.items():
        message = _recipe_error(tmp_path, f"configs:\n  c: {{format: mxfp8, {line}}}\n" + MATCHER)
        assert f"configs.c.{key}" in message, (line, message)


def test_matcher_enabled_must_be_a_boolean(tmp_path):
    message = _recipe_error(tmp_path, "configs:\n  c: {format: mxfp8}\nmatchers:\n"
                                      "  m: {config: c, type: glob, pattern: '*', "
                                      "enabled: 'false'}\n")
    assert "matcher m.enabled: expected true or false, got 'false'" in message


def test_keys_given_twice_are_refused_in_yaml_and_json(tmp_path):
    yaml_text = ("configs:\n  c: {format: mxfp8}\nmatchers:\n"
                 "  m: {config: c, type: glob, pattern: '*fc1', enabled: true}\n"
                 "  m: {config: c, type: glob, pattern: '*fc2', enabled: true}\n")
    assert "'m' is given twice" in _recipe_error(tmp_path, yaml_text)
    json_text = ('{"configs": {"c": {"format": "mxfp8", "format": "mxfp4"}}, "matchers": '
                 '{"m": {"config": "c", "type": "glob", "pattern": "*", "enabled": true}}}')
    assert "'format' is given twice" in _recipe_error(tmp_path, json_text, "recipe.json")


def test_a_recipe_file_that_is_not_a_regular_file_or_too_large_is_one_line(tmp_path):
    """A FIFO would block the reader forever and /dev/zero would read without bound."""
    from megatron.quantization.recipes import MAX_RECIPE_BYTES
    from megatron.quantization.schemes import quant_config

    fifo = tmp_path / "recipe.yaml"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero", str(tmp_path)):
        with pytest.raises(SettingError, match="not a regular file"):
            quant_config(["--quant-recipe-file", path], num_layers=2)
    big = tmp_path / "big.yaml"
    big.write_text("#" * (MAX_RECIPE_BYTES + 1))
    with pytest.raises(SettingError, match="more than a recipe file's"):
        quant_config(["--quant-recipe-file", str(big)], num_layers=2)


def test_matchers_that_decide_no_site_are_named_across_pipeline_stages(tmp_path):
    """A matcher counts when it decides a site on any pipeline stage: the check takes the
    names other stages matched."""
    from megatron.quantization.converter import QuantizationError, check_recipe_matchers
    from megatron.quantization.schemes import quant_config

    path = tmp_path / "recipe.yaml"
    path.write_text("configs:\n  hp: {format: none}\n  c: {format: mxfp8}\nmatchers:\n"
                    "  last: {config: hp, type: glob, pattern: 'decoder.layers.3.*', "
                    "enabled: true}\n"
                    "  rest: {config: c, type: glob, pattern: '*linear_*', enabled: true}\n")
    quant = quant_config(["--quant-recipe-file", str(path)], num_layers=4)
    assert quant.rules.matcher_names == ("last", "rest")
    quant.for_site("linear", 1, "decoder.layers.0.mlp.linear_fc1")
    quant.for_site("linear", 4, "decoder.layers.3.mlp.linear_fc1")
    assert quant.rules.matched_by == {"decoder.layers.0.mlp.linear_fc1": "rest",
                                      "decoder.layers.3.mlp.linear_fc1": "last"}
    assert quant.rules.unmatched({"rest"}) == ["last"]
    check_recipe_matchers(quant, [], matched_elsewhere={"last", "rest"})
    with pytest.raises(QuantizationError, match=r"matcher\(s\) last decide no GEMM site"):
        check_recipe_matchers(quant, [], matched_elsewhere={"rest"})
