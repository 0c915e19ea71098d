"""Whether Triton can run here, and how: read by the kernel package and its launches (a
module of its own, so that the launch helpers need not import the package)."""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """Whether `import triton` works (the package is an optional dependency)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


def interpreter_enabled() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1, read by Triton
    when it is first imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
