"""A progress bar for long replays (tqdm on a terminal, silent otherwise or when disabled).

Contract: ``Progress(total, desc, enabled)``; ``advance(n, virtual_s)`` counts finished requests
and shows the virtual clock; ``close()`` ends the bar. Without a terminal on stderr (CI, pipes)
nothing is drawn unless ``enabled`` is True explicitly.
"""

from __future__ import annotations

import sys
from typing import Any


class Progress:
    def __init__(self, total: int, desc: str, enabled: bool | None = None) -> None:
        show = sys.stderr.isatty() if enabled is None else enabled
        self._bar: Any = None
        if show:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="req", mininterval=0.5, leave=True)

    def advance(self, n: int, virtual_s: float) -> None:
        if self._bar is not None and n:
            self._bar.update(n)
            self._bar.set_postfix_str(f"t={virtual_s:,.0f}s", refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
