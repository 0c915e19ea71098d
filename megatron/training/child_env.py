"""The environment of a child process the tools start (a training, an evaluation, a script)."""

from __future__ import annotations

import os


def with_repository_path(*roots: str, **extra: str) -> dict:
    """os.environ plus `extra`, with `roots` (the repository, and for the tests their folders)
    put in front of the caller's PYTHONPATH, never in its place: megatron.core may come from
    PYTHONPATH, as on many clusters."""
    env = dict(os.environ, **extra)
    paths = list(roots) + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
