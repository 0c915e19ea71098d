"""The visualiser's command line and progress reporting."""

import io
import subprocess
import sys

import pytest

from megatron.analysis.cli import build_parser
from megatron.analysis.progress import Progress


def test_every_flag_has_help():
    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help text"


def test_script_help_runs():
    proc = subprocess.run([sys.executable, "tools/visualization/tensor_visualizer.py", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--tensor-dir" in proc.stdout and "--workers" in proc.stdout


def test_quant_types_is_an_alias_of_quant_schemes():
    parser = build_parser()
    help_text = parser.format_help()
    assert "--quant-schemes" in help_text and "--quant-types" in help_text
    for flag in ("--quant-schemes", "--quant-types"):
        args = parser.parse_args(["--tensor-dir", "x", flag, "bf16", "FA_linear_mxfp8"])
        assert args.quant_schemes == ["bf16", "FA_linear_mxfp8"]


def test_no_input_is_a_usage_error(capsys):
    from megatron.analysis.cli import main

    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2
    assert "--tensor-dir" in capsys.readouterr().err


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_bar_on_a_terminal():
    stream = _Tty()
    bar = Progress(4, 4000, stream=stream)
    for _ in range(4):
        bar._last = 0.0          # redraw on every update
        bar.update(1, 1000)
    bar.close()
    text = stream.getvalue()
    assert text.count("\r") >= 4 and "4/4 records" in text and text.endswith("\n")
