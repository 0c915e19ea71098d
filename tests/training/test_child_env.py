"""The tools start their children with the repository in front of the caller's PYTHONPATH."""

import os

from megatron.training.child_env import with_repository_path


def test_the_callers_pythonpath_is_kept_behind_the_repository(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["/site/megatron-core", "/repo", ""]))
    env = with_repository_path("/repo", OMP_NUM_THREADS="3")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/repo", "/site/megatron-core"]
    assert env["OMP_NUM_THREADS"] == "3"


def test_without_a_pythonpath_the_repository_alone(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    assert with_repository_path("/repo")["PYTHONPATH"] == "/repo"
