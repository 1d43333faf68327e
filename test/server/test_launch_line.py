"""``docs/server.md``'s CPU launch line is what ``ServerConfig`` runs (issue #38: the docs
disagreed about ``--disable-overlap-schedule``; this line is the one place that states it)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

from sglang_hybrid.cpu.server import ServerConfig

ROOT = Path(__file__).resolve().parents[2]


def test_the_documented_line_is_the_one_the_tests_run() -> None:
    doc = (ROOT / "docs" / "server.md").read_text()
    section = doc.split("## The CPU launch line", 1)[1]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block is not None
    line = next(c for c in block[1].replace("\\\n", " ").splitlines() if "launch_server" in c)
    documented = shlex.split(line)[1:]  # without the interpreter
    cfg = ServerConfig(Path("/tmp/tiny"), port=30000, chunked_prefill_size=8192)
    assert documented == cfg.argv()[1:]
    assert "--disable-overlap-schedule" not in documented  # overlap scheduling stays on
    # Every other doc points here instead of stating its own CPU line.
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        if path.name != "server.md":
            text = path.read_text()
            assert "--hybrid-cpu-worker model --device cpu" not in text, path
            assert not re.search(r"--device cpu[^\n]*--disable-overlap-schedule", text), path
