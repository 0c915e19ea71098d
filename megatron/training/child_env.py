"""The environment of a child process the tools start (a training, an evaluation, a script)."""

from __future__ import annotations

import os


def with_repository_path(root: str, **extra: str) -> dict:
    """os.environ plus `extra`, with `root` put in front of the caller's PYTHONPATH, never in
    its place: megatron.core may come from PYTHONPATH, as on many clusters."""
    env = dict(os.environ, **extra)
    paths = [root] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
