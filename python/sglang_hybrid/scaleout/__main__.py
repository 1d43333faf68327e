"""``python -m sglang_hybrid.scaleout``: the scale-out benchmark (``bench.py``)."""

from .bench import main

raise SystemExit(main())
