"""The command-line entry of pretrain_gpt.py: flags first, megatron-core only afterwards.

`--help`, `--quant-check` and bad flags are answered before megatron-core (and its
TransformerEngine/Apex fallback warnings) is imported; a training run then says once that
those optional packages are missing instead of letting megatron-core warn from six modules.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import warnings

from megatron.training.arguments import parse_args, validate_args
from megatron.training.errors import ConfigError, TrainingError
from megatron.training.tokenizer import TokenizerError

# megatron-core's warnings when it falls back from TransformerEngine / Apex to torch code.
FALLBACK_WARNINGS = r"(Transformer Engine and Apex are|Apex is|Transformer Engine is) not installed"


def optional_kernels_notice() -> str:
    """One line on TransformerEngine / Apex, or "" when both are installed."""
    missing = [name for name, module in (("TransformerEngine", "transformer_engine"),
                                         ("Apex", "apex"))
               if importlib.util.find_spec(module) is None]
    if not missing:
        return ""
    return (f"note: {' and '.join(missing)} not installed: megatron-core uses its local "
            "PyTorch implementations (expected on a CPU; the simulated GEMMs never need them)")


def main(forward_step_func, argv=None, extra_args_provider=None,
         code_version: str = "unknown") -> int:
    """Run pretraining; configuration errors become one `error: ...` line and exit code 2.
    `code_version` (the entry point's `git describe`) is recorded as args.git_commit."""
    start_time = time.time()
    try:
        args = validate_args(parse_args(argv, extra_args_provider))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    args.git_commit = code_version
    warnings.filterwarnings("ignore", message=FALLBACK_WARNINGS)
    # Imported here, not at the top: the lines above must not wait for megatron-core.
    from megatron.training.training import is_rank_0, pretrain_with_args

    notice = optional_kernels_notice()
    if notice and is_rank_0() and not args.quant_check:
        print(notice, flush=True)
    try:
        result = pretrain_with_args(forward_step_func, args, start_time=start_time)
    except (ConfigError, TokenizerError) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    except TrainingError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    return result.exit_code
