"""``sgl_kernel_ext`` from its source folder (whether or not ``make kernel-ext`` installed it)."""

from __future__ import annotations

import sys
from pathlib import Path

KEXT = Path(__file__).resolve().parents[2] / "sgl-kernel-ext"
if str(KEXT) not in sys.path:
    sys.path.insert(0, str(KEXT))
