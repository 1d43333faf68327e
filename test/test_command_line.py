"""The ``sglang-hybrid`` command line's own options (issue #38: ``--version`` was "unknown
command")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import sglang_hybrid

# The package under test, whichever copy the interpreter would find by itself.
ENV = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join(
        [str(Path(sglang_hybrid.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    ),
}


@pytest.mark.parametrize("flag", ["--version", "-V", "version"])
def test_version(flag: str) -> None:
    p = subprocess.run(
        [sys.executable, "-m", "sglang_hybrid.cli", flag], capture_output=True, text=True, env=ENV
    )
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith(f"sglang-hybrid {sglang_hybrid.__version__} (sglang "), p.stdout


def test_an_unknown_command_is_named_with_the_usage() -> None:
    p = subprocess.run(
        [sys.executable, "-m", "sglang_hybrid.cli", "bogus"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert p.returncode == 2 and "unknown command 'bogus'" in p.stderr
    assert "--version" in p.stderr
