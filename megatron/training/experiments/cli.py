"""The command line of the package: write or check the generated launchers.

    python -m megatron.training.experiments --write-launchers [--launcher-dir DIR]
    python -m megatron.training.experiments --check-launchers [--launcher-dir DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from megatron.training.experiments.launchers import (
    COMMON_SCRIPT, stale_launchers, write_launchers)

DEFAULT_LAUNCHER_DIR = os.path.join("examples", "llama")


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron.training.experiments",
        description="The experiment matrix. Regenerate or check the examples/llama launchers.",
        allow_abbrev=False)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--write-launchers", action="store_true",
                        help="Write the generated launchers into the launcher directory.")
    action.add_argument("--check-launchers", action="store_true",
                        help="Exit 1 if a generated launcher is missing or out of date.")
    parser.add_argument("--launcher-dir", type=Path, default=Path(DEFAULT_LAUNCHER_DIR),
                        metavar="DIR",
                        help=f"Where the launchers are (default: {DEFAULT_LAUNCHER_DIR}, "
                             "relative to the working directory).")
    args = parser.parse_args(argv)
    if args.write_launchers:
        for path in write_launchers(args.launcher_dir):
            print(f"wrote {os.path.relpath(path)}")
        if not (args.launcher_dir / COMMON_SCRIPT).is_file():
            print(f"note: {args.launcher_dir / COMMON_SCRIPT} is missing; the launchers source "
                  "it (copy it from examples/llama/)", file=sys.stderr)
        return 0
    stale = stale_launchers(args.launcher_dir)
    for path in stale:
        print(f"out of date: {path} (run python -m megatron.training.experiments "
              "--write-launchers)", file=sys.stderr)
    return 1 if stale else 0
