"""The suite's `build_once` fixture (conftest.py): one build per session, failures remembered."""

import pytest


def test_builds_once_and_returns_the_same_folder(build_once):
    calls = []

    def build(folder):
        calls.append(folder)
        (folder / "made").write_text("x")

    first = build_once("test_build_once_ok", build)
    second = build_once("test_build_once_ok", build)
    assert first == second and (first / "made").read_text() == "x" and len(calls) == 1


def test_a_failed_build_fails_every_caller_without_rebuilding(build_once):
    calls = []

    def build(folder):
        calls.append(folder)
        raise RuntimeError("launch broke")

    with pytest.raises(RuntimeError, match="launch broke"):
        build_once("test_build_once_failed", build)
    with pytest.raises(AssertionError, match="RuntimeError: launch broke"):
        build_once("test_build_once_failed", build)
    assert len(calls) == 1
