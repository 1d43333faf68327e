"""``python -m sglang_hybrid.replay ...``: see ``cli``."""

from sglang_hybrid.replay.cli import main

raise SystemExit(main())
