"""Test files whose Triton kernels run under Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so such a file runs its kernel
checks as a script in a subprocess with the interpreter on, printing one JSON line of
measurements, which its tests read; the pytest process itself never imports triton.
"""

import json
import os
import subprocess
import sys

from conftest import REPO_ROOT, child_env


def run_interpreted(test_file: str, timeout: int, *args: str) -> dict:
    """The JSON line `test_file`, run as a script under the interpreter, prints last."""
    env = child_env(TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, os.path.abspath(test_file), *args], env=env,
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def require_interpreter() -> None:
    """Stop a script run without the interpreter (its kernels would need a GPU)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1 (the tests in this file do)")
