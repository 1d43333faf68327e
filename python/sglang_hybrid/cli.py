"""``sglang-hybrid``: the package's command line, a dispatcher over subcommands.

``sglang-hybrid replay ...`` runs the trace-replay benchmark (``sglang_hybrid.replay.cli``);
``sglang-hybrid cache inspect PATH`` prints what a host tier file holds (``store/cache_inspect``);
``sglang-hybrid scaleout`` measures reuse through SGLang's router (``scaleout/bench``);
``sglang-hybrid --version`` prints this package's version and the installed SGLang's.
Subcommand modules are imported only when chosen, so ``--help`` stays fast.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: sglang-hybrid <command> [args...]
       sglang-hybrid --version

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
    if command in ("--version", "-V", "version"):
        print(version_line())
        return 0
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


def version_line() -> str:
    """This package's version and the SGLang it is installed with (the plugin is written for
    one SGLang version: a mismatch is the first thing to check)."""
    import importlib.metadata

    from sglang_hybrid import __version__

    def dist(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return f"sglang-hybrid {__version__} (sglang {dist('sglang')}; written for sglang 0.5.23)"


if __name__ == "__main__":
    raise SystemExit(main())
