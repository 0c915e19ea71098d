"""The experiment matrix, train_config.py / flash_attention_config.py and the generated launchers.

Every command is checked with the real pretrain_gpt.py parser: `parse_args` on the produced
flags, then `validate_args(check_paths=False)` with the world size the command launches.
"""

import os
import shlex
import shutil
import subprocess
import sys

import pytest

from megatron.quantization import config as quant_schemes
from megatron.training import experiments as ex
from megatron.training.arguments import parse_args, validate_args
from megatron.training.experiments import cli, launchers
from megatron.training.experiments.preset_flags import preset_flags
from megatron.training.presets import MODEL_PRESETS

from conftest import REPO_ROOT
sys.path.insert(0, REPO_ROOT)
import train_config  # noqa: E402

PY = sys.executable
LAUNCHERS = os.path.join(REPO_ROOT, "examples", "llama")
COMMON_SH = os.path.join(LAUNCHERS, launchers.COMMON_SCRIPT)
PRETRAIN_SCRIPT = os.path.join(REPO_ROOT, "pretrain_gpt.py")
SCHEMES = quant_schemes.SEED_SCHEMES   # the matrix's ten


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "CUSTOM_QUANT_TYPE", "TENSOR_SAVE_ENABLED",
                "TENSOR_SAVE_DIR", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
                "OMP_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS"):
        monkeypatch.delenv(var, raising=False)


def split_command(line):
    """(env, launcher tokens, pretrain_gpt.py flags, world size) of one printed command."""
    tokens = shlex.split(line)
    env = {}
    while tokens and "=" in tokens[0] and not tokens[0].startswith("-"):
        key, value = tokens.pop(0).split("=", 1)
        env[key] = value
    i = next(i for i, t in enumerate(tokens) if t.endswith("pretrain_gpt.py"))
    launcher, flags = tokens[:i], tokens[i + 1:]

    def launcher_value(name, default):
        return int(launcher[launcher.index(name) + 1]) if name in launcher else default

    world = launcher_value("--nproc-per-node", 1) * launcher_value("--nnodes", 1)
    return env, launcher, flags, world


def validated(flags, world_size):
    args = parse_args(flags)
    args.world_size, args.rank = world_size, 0
    return validate_args(args, check_paths=False)


def dry_run(capsys, argv, fa=False):
    argv = list(argv)
    at = argv.index("--") if "--" in argv else len(argv)
    assert train_config.main(argv[:at] + ["--dry-run"] + argv[at:], fa=fa) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1, out
    return split_command(out[0])


def cli_error(capsys, argv, fa=False):
    with pytest.raises(SystemExit) as exc:
        train_config.main(list(argv), fa=fa)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ---------------------------------------------------------------------------------------------
# The matrix
# ---------------------------------------------------------------------------------------------


class TestMatrix:
    def test_names(self):
        assert ex.MATRIX_MODELS == ("llama31-8b", "llama32-1b", "deepseek2_lite")
        assert ex.DATASETS == ("wikipedia", "dolma")
        assert len(SCHEMES) == 10
        assert ex.TRAINING_CONFIG_NAMES == ("fast", "standard")
        assert len(ex.matrix()) == 3 * 2 * 10 * 2
        for spec in ex.MODELS.values():
            assert spec.preset in MODEL_PRESETS
            assert set(spec.training) == set(ex.TRAINING_CONFIG_NAMES)

    def test_aliases(self):
        assert ex.resolve_model("deepseek2-lite") is ex.resolve_model("deepseek2_lite")
        a = ex.build_command(ex.Experiment("deepseek2-lite", "dolma", "FA_mxfp4"), PRETRAIN_SCRIPT)
        b = ex.build_command(ex.Experiment("deepseek2_lite", "dolma", "FA_mxfp4"), PRETRAIN_SCRIPT)
        assert a.argv == b.argv

    def test_quant_scheme_names_match_the_quantization_package(self):
        """The matrix spells the scheme names itself (no torch import); they must agree."""
        assert ex.QUANT_SCHEMES == quant_schemes.SEED_SCHEMES
        assert ex.ELEMENT_FORMATS == quant_schemes.SEED_FORMATS
        assert ex.ALL_QUANT_SCHEMES == quant_schemes.SCHEMES

    def test_pretrain_script_is_the_callers(self, tmp_path):
        script = tmp_path / "elsewhere" / "pretrain_gpt.py"
        cmd = ex.build_command(ex.Experiment("llama-tiny", "mock", "bf16"), script)
        assert cmd.script == str(script) and cmd.argv[cmd.argv.index(str(script)) + 1:] == \
            cmd.pretrain_args

    @pytest.mark.parametrize("kind,expected", [
        ("models", ["llama31-8b", "llama32-1b", "deepseek2_lite", "llama-tiny",
                    "deepseek-tiny", "deepseek2-lite"]),
        ("datasets", ["wikipedia", "dolma", "mock"]),
        ("schemes", list(SCHEMES)),
        ("training-configs", ["fast", "standard"]),
    ])
    def test_names_cli(self, capsys, kind, expected):
        assert train_config.main(["--names", kind]) == 0
        assert capsys.readouterr().out.split() == expected

    def test_list(self, capsys):
        assert train_config.main(["--list"]) == 0
        out = capsys.readouterr().out
        for name in list(ex.MODELS) + list(ex.ALL_DATASETS) + list(SCHEMES) + ["fast", "standard"]:
            assert name in out
        assert "deepseek2-lite" in out  # the alias is listed

    def test_list_names_every_accepted_scheme_and_marks_the_matrix(self, capsys):
        """--list shows every scheme --quant-scheme accepts (the ten of the matrix and the
        newer formats'), one line each, the matrix's marked; --help names them all too."""
        assert train_config.main(["--list"]) == 0
        out = capsys.readouterr().out
        lines = {line.split()[0]: line for line in out.splitlines()
                 if line.startswith("  ") and line.split()[0] in ex.ALL_QUANT_SCHEMES}
        assert list(lines) == list(ex.ALL_QUANT_SCHEMES) and len(lines) == 22
        marked = [name for name, line in lines.items() if "[matrix]" in line]
        assert marked == list(SCHEMES)
        assert "NVFP4" in lines["FA_linear_nvfp4"] and "MXFP6 (E2M3)" in lines["linear_mxfp6_e2m3"]
        assert "[matrix]" in out.split("Quantization schemes")[1].splitlines()[0]
        with pytest.raises(SystemExit):
            train_config.main(["--help"])
        help_text = " ".join(capsys.readouterr().out.split())
        for name in ex.ALL_QUANT_SCHEMES:
            assert name in help_text

    def test_list_subprocess(self):
        """The real command line, once: --list from another working directory."""
        out = subprocess.run([PY, os.path.join(REPO_ROOT, "train_config.py"), "--list"],
                             capture_output=True, text=True, cwd="/", timeout=120)
        assert out.returncode == 0, out.stderr
        assert "FA_linear_hifp8" in out.stdout and "deepseek2_lite" in out.stdout

    def test_quiet_light_start_up(self):
        """--help, --list, --dry-run and --print-schemes import neither torch nor megatron.core
        (so no TransformerEngine / Apex warnings and well under a second of start-up)."""
        code = ("import sys, contextlib, io\n"
                "import train_config\n"
                "for argv in (['--list'], ['--model', 'llama31-8b', '--dataset', 'wikipedia',\n"
                "             '--quant-scheme', 'all', '--dry-run'],\n"
                "             ['--model', 'llama-tiny', '--dataset', 'mock', '--print-schemes']):\n"
                "    with contextlib.redirect_stdout(io.StringIO()):\n"
                "        assert train_config.main(argv) == 0\n"
                "heavy = ('torch', 'megatron.core', 'transformer_engine', 'apex')\n"
                "print(sorted(m for m in heavy if m in sys.modules))\n")
        out = subprocess.run([PY, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == "[]"
        assert "UserWarning" not in out.stderr and "Apex" not in out.stderr, out.stderr
        # The only possible warning is the plan's (8B tokens on the 1.66 M-token embedded
        # corpus), when that corpus is built; tests/test_budget.py checks it.
        warnings = [l for l in out.stderr.splitlines() if "warning" in l.lower()]
        assert all("epoch" in l for l in warnings), out.stderr

    def test_library_does_not_reach_into_the_checkout(self):
        """Paths come from the callers; nothing under the package locates the repository."""
        package = os.path.dirname(ex.__file__)
        for name in sorted(os.listdir(package)):
            if name.endswith(".py"):
                with open(os.path.join(package, name)) as f:
                    text = f.read()
                for word in ("__file__", "sys.path", "REPO_ROOT", ".parents["):
                    assert word not in text, (name, word)


# ---------------------------------------------------------------------------------------------
# Dry runs of every combination, validated by the real parser
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(ex.MODELS))
@pytest.mark.parametrize("dataset", list(ex.ALL_DATASETS))
def test_every_combination_is_a_valid_command(capsys, model, dataset):
    spec = ex.resolve_model(model)
    for config in ex.TRAINING_CONFIG_NAMES:
        cfg = spec.training[config]
        for scheme in SCHEMES:
            env, launcher, flags, world = dry_run(capsys, [
                "--model", model, "--dataset", dataset, "--quant-scheme", scheme,
                "--training-config", config])
            assert launcher[0] == "torchrun" or launcher[0].endswith("torchrun")
            assert world == spec.nproc_per_node
            args = validated(flags, world)
            assert args.model_preset == spec.preset
            assert args.quant_scheme == scheme and args.quant_config.scheme == scheme
            assert args.seq_length == cfg.seq_length
            assert args.train_iters == cfg.train_iters
            assert args.lr_warmup_iters < args.lr_decay_iters  # megatron.core asserts this
            assert args.bf16
            assert args.tensor_model_parallel_size == spec.tensor_parallel
            assert args.expert_model_parallel_size == spec.expert_parallel
            assert (args.save is not None) == cfg.checkpoints
            assert args.save_tensors is False
            if dataset == "mock":
                assert args.mock_data and args.tokenizer_type == "NullTokenizer"
                assert args.vocab_size == spec.mock_vocab_size
            else:
                assert args.data_path == [ex.data_prefix(dataset)]
                assert args.tokenizer_type == "Llama3Tokenizer"
            if spec.target == "gpu":
                assert env == {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
            else:
                assert args.distributed_backend == "gloo"
    # The quantized sites follow the scheme name.
    args = validated(dry_run(capsys, ["--model", model, "--dataset", dataset,
                                      "--quantization", "FA_linear_mxfp4"])[2],
                     spec.nproc_per_node)
    assert args.quant_config.linear.enabled and args.quant_config.attn_qk.enabled
    assert not args.quant_config.attn_pv.enabled


@pytest.mark.parametrize("model", list(ex.MODELS))
def test_flash_attention_config(capsys, model):
    spec = ex.resolve_model(model)
    for name, (scheme, pv) in ex.FA_QUANTIZATIONS.items():
        for config in ex.TRAINING_CONFIG_NAMES:
            _, _, flags, world = dry_run(capsys, [
                "--model", model, "--dataset", "wikipedia", "--fa-quantization", name,
                "--training-config", config], fa=True)
            args = validated(flags, world)
            assert args.quant_scheme == scheme
            qc = args.quant_config
            assert not qc.linear.enabled
            assert qc.attn_qk.enabled == (name != "none")
            assert qc.attn_pv.enabled == name.startswith("qk_pv_")
            if pv is not None:
                assert args.attn_pv_quant == pv
                assert name.endswith(pv) and scheme == f"FA_{pv}"
    assert spec.name in ex.MODELS


def test_fa_mapping():
    assert ex.fa_quantization("qk_mxfp8") == ("FA_mxfp8", None)
    assert ex.fa_quantization("qk_pv_hifp8") == ("FA_hifp8", "hifp8")
    assert ex.fa_quantization("none") == ("bf16", None)
    assert list(ex.FA_QUANTIZATIONS) == ["qk_mxfp8", "qk_mxfp4", "qk_hifp8", "qk_pv_mxfp8",
                                         "qk_pv_mxfp4", "qk_pv_hifp8", "none"]


# ---------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------


class TestOptions:
    def test_capture_pass_through(self, capsys, tmp_path):
        _, _, flags, world = dry_run(capsys, [
            "--model", "llama-tiny", "--dataset", "mock", "--quant-scheme", "linear_hifp8",
            "--training-config", "fast", "--save-tensors", "--tensor-save-dir", str(tmp_path),
            "--control-iter", "2", "--collect-micro-batches", "2"])
        args = validated(flags, world)
        assert args.save_tensors and args.tensor_save_dir == str(tmp_path)
        assert (args.control_iter, args.collect_micro_batches) == (2, 2)

    def test_capture_flags_need_save_tensors(self, capsys):
        err = cli_error(capsys, ["--model", "llama-tiny", "--dataset", "mock",
                                 "--control-iter", "2"])
        assert "--control-iter need --save-tensors" in err

    def test_extra_flags_override(self, capsys):
        _, _, flags, world = dry_run(capsys, [
            "--model", "llama-tiny", "--dataset", "mock", "--training-config", "fast",
            "--", "--train-iters", "3", "--seq-length", "64"])
        args = validated(flags, world)
        assert (args.train_iters, args.seq_length) == (3, 64)
        # A shortened run keeps the recipe's schedule (warm-up < decay still holds).
        assert args.lr_decay_iters == ex.MODELS["llama-tiny"].training["fast"].train_iters
        assert args.lr_warmup_iters < args.lr_decay_iters

    def test_nproc_and_nodes(self, capsys):
        env, launcher, flags, world = dry_run(capsys, [
            "--model", "llama-tiny", "--dataset", "mock", "--nproc-per-node", "2"])
        assert env == {"OMP_NUM_THREADS": "1"} and world == 2 and "--standalone" in launcher
        validated(flags, world)
        env, launcher, flags, world = dry_run(capsys, [
            "--model", "llama31-8b", "--dataset", "wikipedia", "--nnodes", "2",
            "--node-rank", "1", "--master-addr", "node0", "--master-port", "6001"])
        assert world == 16 and "--standalone" not in launcher
        assert launcher[launcher.index("--master-addr") + 1] == "node0"
        args = validated(flags, world)
        assert args.data_parallel_size == 8 and args.sequence_parallel

    def test_bare_format_means_fa_linear(self, capsys):
        assert train_config.main(["--model", "llama-tiny", "--dataset", "mock",
                                  "--quantization", "hifp8", "--dry-run"]) == 0
        captured = capsys.readouterr()
        assert "--quant-scheme FA_linear_hifp8" in captured.out
        assert "FA_linear_hifp8" in captured.err

    def test_quantization_is_an_alias_of_quant_scheme(self, capsys):
        argv = ["--model", "llama32-1b", "--dataset", "mock", "--dry-run"]
        assert train_config.main(argv + ["--quant-scheme", "FA_mxfp4"]) == 0
        primary = capsys.readouterr().out
        assert train_config.main(argv + ["--quantization", "FA_mxfp4"]) == 0
        assert capsys.readouterr().out == primary and "--quant-scheme FA_mxfp4" in primary
        help_text = train_config.build_parser().format_help()
        assert "--quant-scheme SCHEME, --quantization SCHEME" in help_text

    def test_print_schemes(self, capsys, tmp_path):
        """One canonical scheme per line, after the same checks as --dry-run / --check."""
        argv = ["--model", "llama-tiny", "--dataset", "mock", "--print-schemes"]
        assert train_config.main(argv + ["--quant-scheme", "mxfp4,bf16", "--quantization",
                                         "FA_linear_mxfp4"]) == 0
        captured = capsys.readouterr()
        assert captured.out.splitlines() == ["FA_linear_mxfp4", "bf16"]
        assert "means FA_linear_mxfp4" in captured.err
        assert train_config.main(argv + ["--quant-scheme", "all"]) == 0
        assert capsys.readouterr().out.splitlines() == list(SCHEMES)
        err = cli_error(capsys, argv + ["--quant-scheme", "FA_fp4"])
        assert "'FA_fp4'" in err
        missing = ["--model", "llama-tiny", "--dataset", "dolma", "--data-root", str(tmp_path),
                   "--print-schemes"]
        assert train_config.main(missing) == 0
        assert capsys.readouterr().out == "bf16\n"
        assert train_config.main(missing + ["--check"]) == 2
        assert "build_corpus.py --dataset dolma" in capsys.readouterr().err
        assert train_config.main(["--model", "llama31-8b", "--dataset", "mock",
                                  "--fa-quantization", "qk_pv_hifp8", "--print-schemes"],
                                 fa=True) == 0
        assert capsys.readouterr().out == "FA_hifp8\n"

    def test_paths(self, capsys, tmp_path):
        _, _, flags, world = dry_run(capsys, [
            "--model", "llama32-1b", "--dataset", "dolma", "--run-dir", str(tmp_path),
            "--tokenizer-model", "/models/tokenizer.json"])
        args = validated(flags, world)
        assert args.save == args.load == str(tmp_path / "checkpoints")
        assert args.tensorboard_dir == str(tmp_path / "tensorboard")
        assert args.tokenizer_type == "HuggingFaceTokenizer"
        assert args.tokenizer_model == "/models/tokenizer.json"
        _, _, flags, world = dry_run(capsys, [
            "--model", "llama32-1b", "--dataset", "dolma", "--no-checkpoints"])
        assert validated(flags, world).save is None
        # '{scheme}' in a path stands for each command's scheme.
        assert train_config.main(["--model", "llama-tiny", "--dataset", "mock", "--quant-scheme",
                                  "bf16,FA_mxfp4", "--tensorboard-dir", "tb/{scheme}",
                                  "--dry-run"]) == 0
        lines = capsys.readouterr().out.splitlines()
        assert "--tensorboard-dir tb/bf16" in lines[0]
        assert "--tensorboard-dir tb/FA_mxfp4" in lines[1]

    @pytest.mark.parametrize("argv,expected", [
        (["--model", "gpt5", "--dataset", "mock"], ["'gpt5'", "llama31-8b", "deepseek2_lite"]),
        (["--model", "llama-tiny", "--dataset", "c4"], ["'c4'", "wikipedia, dolma, mock"]),
        (["--model", "llama-tiny", "--dataset", "mock", "--quantization", "fp8"],
         ["'fp8'", "FA_linear_hifp8"]),
        (["--model", "llama-tiny", "--dataset", "mock", "--training-config", "slow"],
         ["'slow'", "fast, standard"]),
        (["--model", "llama31-8b", "--dataset", "mock", "--nproc-per-node", "3"],
         ["(3)", "multiple"]),
        (["--model", "deepseek2_lite", "--dataset", "mock", "--nproc-per-node", "4"],
         ["expert parallel size 8"]),
        (["--model", "llama-tiny", "--dataset", "mock", "--nproc-per-node", "0"], ["0"]),
        (["--dataset", "mock"], ["--model is required"]),
    ])
    def test_bad_values(self, capsys, argv, expected):
        err = cli_error(capsys, argv)
        for text in expected:
            assert text in err

    def test_bad_fa_quantization(self, capsys):
        err = cli_error(capsys, ["--model", "llama-tiny", "--dataset", "mock",
                                 "--fa-quantization", "qk_fp8"], fa=True)
        assert "'qk_fp8'" in err and "qk_pv_mxfp8" in err

    def test_check_reports_missing_data(self, capsys, tmp_path):
        argv = ["--model", "llama-tiny", "--dataset", "wikipedia", "--data-root", str(tmp_path)]
        assert train_config.main(argv + ["--dry-run"]) == 0
        assert "build_corpus.py --dataset wikipedia" in capsys.readouterr().err
        assert train_config.main(argv + ["--check"]) == 2
        assert "build_corpus.py --dataset wikipedia" in capsys.readouterr().err
        assert train_config.main(argv) == 2   # and never starts a run

    def test_run_streams_and_propagates_exit_code(self, monkeypatch, tmp_path, capfd):
        code = "import sys; print('child ran', len(sys.argv) > 5); sys.exit(3)"
        monkeypatch.setattr(ex, "resolve_torchrun", lambda: [PY, "-c", code])
        rc = train_config.main(["--model", "llama-tiny", "--dataset", "mock",
                                "--run-dir", str(tmp_path)])
        assert rc == 3
        out = capfd.readouterr().out
        assert "child ran True" in out and "[train_config] torchrun" in out
        assert (tmp_path / "checkpoints").is_dir()  # --load needs it to exist


# ---------------------------------------------------------------------------------------------
# Generated launchers
# ---------------------------------------------------------------------------------------------


def test_launchers_in_sync():
    """Fails while a generated launcher differs from what the matrix renders."""
    stale = launchers.stale_launchers(LAUNCHERS)
    assert not stale, ("regenerate with: python -m megatron.training.experiments "
                       f"--write-launchers ({stale})")
    expected = set(launchers.render_launchers())
    assert launchers.COMMON_SCRIPT not in expected   # written by hand
    on_disk = {f for f in os.listdir(LAUNCHERS) if f.endswith(".sh")}
    assert on_disk == expected | {launchers.COMMON_SCRIPT}
    for name in expected:
        assert os.access(os.path.join(LAUNCHERS, name), os.X_OK)


def test_write_and_check_launchers_cli(tmp_path, capsys):
    """The CLI writes to and checks the directory it is given."""
    target = tmp_path / "llama"
    assert cli.main(["--write-launchers", "--launcher-dir", str(target)]) == 0
    assert "common.sh is missing" in capsys.readouterr().err
    assert sorted(p.name for p in target.iterdir()) == sorted(launchers.render_launchers())
    assert cli.main(["--check-launchers", "--launcher-dir", str(target)]) == 0
    edited = target / "train_tiny_cpu.sh"
    edited.write_text(edited.read_text() + "# edited by hand\n")
    assert cli.main(["--check-launchers", "--launcher-dir", str(target)]) == 1
    assert str(edited) in capsys.readouterr().err
    edited.unlink()
    assert launchers.stale_launchers(target) == [str(edited)]


def test_python_module_entry_point(tmp_path):
    out = subprocess.run([PY, "-m", "megatron.training.experiments", "--check-launchers",
                          "--launcher-dir", LAUNCHERS], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    out = subprocess.run([PY, "-m", "megatron.training.experiments", "--write-launchers"],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr   # default: examples/llama under the working dir
    assert (tmp_path / "examples" / "llama" / "train_llama32_1b.sh").is_file()


def _launcher_body(text):
    """The lines of a launcher after its header, without comments and blank lines."""
    lines = text.splitlines()
    body = lines[lines.index("set -euo pipefail") + 1:]
    return [line.strip() for line in body if line.strip() and not line.lstrip().startswith("#")]


def test_launchers_hold_only_model_specific_lines():
    """A source line, the values of the model and the matrix, and one call into common.sh."""
    with open(COMMON_SH) as f:
        common = f.read()
    shared = ["POSITIONAL=(", "TOKENIZER_ARGS=(", "DATA_ARGS_LIST=(", "QUANT_ARGS=(",
              "DISTRIBUTED_ARGS=(", "CMD=(", "printf '%q '", "usage()", "exec ", "torchrun",
              "LAUNCH=(", "if ", "for ", "()"]
    for name, text in launchers.render_launchers().items():
        body = _launcher_body(text)
        assert body[0] == 'source "$(dirname "${BASH_SOURCE[0]}")/common.sh"', name
        assert body[-1] in ('run_on_gpus "$@"', 'run_on_cpu "$@"'), name
        for line in body[1:-1]:
            for snippet in shared:
                assert snippet not in line, (name, snippet)
        assert f"QUANT_SCHEMES=({' '.join(ex.QUANT_SCHEMES)})" in body
        assert f"DATA_SPLIT={ex.DATA_SPLIT}" in body
    for snippet in shared[:-4]:
        assert snippet in common, snippet


def test_common_sh_takes_matrix_values_from_the_launcher():
    """common.sh is hand-written: no scheme, dataset or recipe value is spelled in it."""
    with open(COMMON_SH) as f:
        code = "\n".join(line for line in f if not line.lstrip().startswith("#"))
    for value in list(ex.QUANT_SCHEMES[1:]) + list(ex.DATASETS) + [ex.DATA_SPLIT, "8192",
                                                                   "128256"]:
        assert value not in code, value


def test_launchers_use_common_sh_beside_them(tmp_path):
    """A copy of examples/llama elsewhere runs with its own common.sh and repository root."""
    llama = tmp_path / "examples" / "llama"
    launchers.write_launchers(llama)
    shutil.copy(COMMON_SH, llama)
    (tmp_path / "pretrain_gpt.py").write_text("")
    for name in launchers.render_launchers():
        proc = subprocess.run(["bash", str(llama / name), "c", "t"], capture_output=True,
                              text=True, cwd="/", timeout=60, env=dict(os.environ, DRY_RUN="1"))
        assert proc.returncode == 0, proc.stderr
        _, _, flags, world = split_command(proc.stdout)
        assert str(tmp_path / "pretrain_gpt.py") in shlex.split(proc.stdout)
        validated(flags, world)
    (llama / launchers.COMMON_SCRIPT).unlink()
    for name in launchers.render_launchers():
        proc = subprocess.run(["bash", str(llama / name), "c", "t"], capture_output=True,
                              text=True, timeout=60, env=dict(os.environ, DRY_RUN="1"))
        assert proc.returncode != 0 and proc.stdout == ""
        assert launchers.COMMON_SCRIPT in proc.stderr


def test_common_sh_is_not_run_directly():
    proc = subprocess.run(["bash", COMMON_SH], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "is sourced by the launchers beside it, not run" in proc.stderr


@pytest.mark.parametrize("preset", sorted(MODEL_PRESETS))
def test_preset_flags_equal_preset(preset):
    """The launchers' explicit MODEL_ARGS mean exactly --model-preset."""
    common = ["--seq-length", "128", "--micro-batch-size", "1", "--train-iters", "1",
              "--lr", "1e-4", "--mock-data", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "512"]
    explicit = vars(parse_args(preset_flags(preset) + common))
    via_preset = vars(parse_args(["--model-preset", preset] + common))
    for dest in MODEL_PRESETS[preset]:
        if dest != "seq_length":
            assert explicit[dest] == via_preset[dest], dest


def run_launcher(name, positional, env=None):
    full_env = dict(os.environ, DRY_RUN="1", **(env or {}))
    return subprocess.run(["bash", os.path.join(LAUNCHERS, name), *positional],
                          capture_output=True, text=True, env=full_env, timeout=60)


@pytest.mark.parametrize("model", [m for m in ex.MODELS if ex.MODELS[m].target == "gpu"])
def test_cluster_launcher_commands(model, tmp_path):
    spec = ex.MODELS[model]
    for data, scheme in (("MOCK", "bf16"), ("wikipedia", "FA_linear_mxfp4"),
                         ("/data/my_corpus_text_document", "linear_hifp8")):
        proc = run_launcher(spec.launcher, [str(tmp_path / "ckpt"), str(tmp_path / "tb"),
                                            "DEFAULT", data, scheme, "--train-iters", "7"],
                            env={"GPUS_PER_NODE": "8", "NNODES": "2", "NODE_RANK": "1"})
        assert proc.returncode == 0, proc.stderr
        env, launcher, flags, world = split_command(proc.stdout)
        assert launcher[0] == "torchrun" and world == 16
        args = validated(flags, world)
        assert args.quant_scheme == scheme and args.train_iters == 7 and args.bf16
        assert args.save == args.load == str(tmp_path / "ckpt")
        assert args.tensorboard_dir == str(tmp_path / "tb")
        assert args.num_layers == MODEL_PRESETS[spec.preset]["num_layers"]
        assert args.tensor_model_parallel_size == spec.tensor_parallel
        if data == "MOCK":
            assert args.mock_data and args.vocab_size == ex.LLAMA3_VOCAB_SIZE
        elif data == "wikipedia":
            assert args.data_path == [os.path.join(REPO_ROOT, "data", "wikipedia",
                                                   "wikipedia_text_document")]
            assert args.split == ex.DATA_SPLIT
        else:
            assert args.data_path == [data]
    assert not (tmp_path / "ckpt").exists()  # a dry run creates nothing


def test_cpu_launcher_commands(tmp_path):
    for model in ex.TINY_MODELS:
        for nproc in ("1", "2"):
            proc = run_launcher("train_tiny_cpu.sh", [str(tmp_path / "c"), str(tmp_path / "t"),
                                                      "DEFAULT", "MOCK", "FA_hifp8"],
                                env={"MODEL": model, "NPROC": nproc})
            assert proc.returncode == 0, proc.stderr
            tokens = shlex.split(proc.stdout)
            i = next(i for i, t in enumerate(tokens) if t.endswith("pretrain_gpt.py"))
            if nproc == "1":
                assert i == 1  # python pretrain_gpt.py
            else:
                assert tokens[1:4] == ["-m", "torch.distributed.run", "--standalone"]
            args = validated(tokens[i + 1:], int(nproc))
            assert args.distributed_backend == "gloo" and args.quant_scheme == "FA_hifp8"
            assert args.num_layers == MODEL_PRESETS[model]["num_layers"]


@pytest.mark.parametrize("positional,env,message", [
    (["c", "t", "DEFAULT", "MOCK", "fp8"], {},
     f"unknown QUANT_SCHEME 'fp8'; valid: {', '.join(SCHEMES)}"),
    (["c"], {}, "CHECKPOINT_PATH and TENSORBOARD_LOGS_PATH are required"),
    (["c", "t"], {"MODEL": "gpt2"}, "unknown MODEL 'gpt2'; valid: llama-tiny, deepseek-tiny"),
    (["c", "t"], {"NPROC": "two"}, "NPROC=two is not a positive integer"),
    (["--help"], {"NPROC": "two"}, "NPROC=two is not a positive integer"),
])
def test_launcher_errors(positional, env, message):
    proc = run_launcher("train_tiny_cpu.sh", positional, env=env)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.startswith(f"error: {message}") and len(proc.stderr.splitlines()) == 1


def test_launchers_bash_syntax_and_help():
    assert subprocess.run(["bash", "-n", COMMON_SH]).returncode == 0
    for name in launchers.render_launchers():
        path = os.path.join(LAUNCHERS, name)
        assert subprocess.run(["bash", "-n", path]).returncode == 0
        proc = subprocess.run(["bash", path, "--help"], capture_output=True, text=True)
        assert proc.returncode == 0 and "CHECKPOINT_PATH" in proc.stdout
        # The help is the launcher's own header (common.sh prints it), not common.sh's.
        assert proc.stdout.startswith("Pretrain ") and f"examples/llama/{name}" in proc.stdout
        assert "set -euo" not in proc.stdout and "sourced, not run" not in proc.stdout
