"""``sglang-hybrid``: the package's command line, a dispatcher over subcommands.

``sglang-hybrid replay ...`` runs the trace-replay benchmark (``sglang_hybrid.replay.cli``);
``sglang-hybrid cache inspect PATH`` prints what a host tier file holds (``store/cache_inspect``);
``sglang-hybrid scaleout`` measures reuse through SGLang's router (``scaleout/bench``).
Subcommand modules are imported only when chosen, so ``--help`` stays fast.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: sglang-hybrid <command> [args...]

commands:
  replay    replay traces against prefix caches through SGLang's scheduler on the CPU
            (sglang-hybrid replay --help)
  cache     host tier files of --hybrid-cache-file: sglang-hybrid cache inspect PATH
  scaleout  reuse through SGLang's router, N servers per policy against one
            (sglang-hybrid scaleout --help; docs/scale-out.md)
"""


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "replay":
        from sglang_hybrid.replay.cli import main as replay_main

        return replay_main(rest)
    if command == "cache":
        from sglang_hybrid.store.cache_inspect import main as cache_main

        return cache_main(rest)
    if command == "scaleout":
        from sglang_hybrid.scaleout.bench import main as scaleout_main

        return scaleout_main(rest)
    print(f"sglang-hybrid: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
