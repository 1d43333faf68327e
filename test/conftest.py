"""Shared pytest setup: make the package importable from a source checkout without install."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))


def pytest_addoption(parser):
    parser.addoption(
        "--index-ops",
        type=int,
        default=20_000,
        help="operations in the seeded random index test (make stress-index runs more)",
    )
