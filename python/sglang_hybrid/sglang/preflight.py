"""Refusals at the command line, before anything is loaded (issue #38).

A launch the plugin cannot serve used to be refused half a minute in, as a 20-line traceback
ending in our message: the checks ran when SGLang resolved its arguments, after its plugins had
imported every hooked module. Now:

- **In the launcher, as the plugin registers** (:func:`preflight`, called first thing by
  ``plugin.register``): SGLang calls ``register`` from ``load_plugins``, which runs after
  ``sglang.launch_server`` imported SGLang and before any hook is applied or anything else of
  ours is imported. Where that process runs SGLang's server command line (:func:`from_cli`),
  the arguments are parsed here with SGLang's own parser plus our flags, and checked
  (:func:`check_namespace`). A refusal is one line on stderr, ``sglang serve: error:
  [sglang-hybrid] <flag>: <why>; <fix>``, exit status 2 (argparse's), no traceback. What remains
  before it is SGLang's import (about 5 s on an idle machine of this project; the rest of the
  old 11-34 s was plugin and hook imports, argument resolution and model loading).
- A misspelt flag is refused the same way with the nearest known flag, but only where every
  installed SGLang plugin is ours: another plugin may add flags this parser does not know, and
  then SGLang's own parser decides a moment later.
- **After SGLang parsed** (``ServerArgs.from_cli_args``, ``plugin._from_cli_args``): the same
  checks for what did not pass through here (``sglang serve``, a ``--config`` file SGLang
  merges, a program calling ``prepare_server_args``); in a program they raise ``ConfigError``.

Checks (each message names the flag and the fix): ``checks.check_server_args`` (what the cache
cannot honour), contradictory flags (``--disable-radix-cache`` with ``--radix-cache hybrid``;
a ``--hybrid-*`` cache flag without ``--radix-cache hybrid``), option values (``resolve_config``'s
bounds, ``--hybrid-cache-file``, ``--hybrid-l3``'s URL), and ``--device cpu`` without
``--hybrid-cpu-worker`` where SGLang's own CPU engine cannot run (it then stops minutes later in
"Found no NVIDIA driver").
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from ..index import ConfigError

PROG = "sglang serve"  # SGLang's parser's name (``prepare_server_args``)
CPU_WORKER_FLAG = "--hybrid-cpu-worker"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
OUR_DIST = "sglang-hybrid"


def from_cli() -> bool:
    """This process runs SGLang's server command line (``python -m sglang.launch_server``,
    ``sglang serve``): not a spawned child, not a program building its arguments in code."""
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        return False
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name == "sglang.launch_server":
        return True
    return Path(sys.argv[0]).name == "sglang" and sys.argv[1:2] == ["serve"]


def refuse(message: str) -> NoReturn:
    """One line, argparse's exit status, no traceback."""
    sys.stderr.write(f"{PROG}: error: [sglang-hybrid] {message}\n")
    sys.stderr.flush()
    raise SystemExit(2)


def preflight() -> None:
    """Parse and check ``python -m sglang.launch_server``'s arguments before anything is loaded
    (see the module docstring); returns quietly when this process is not such a launch."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if not from_cli() or spec is None or spec.name != "sglang.launch_server":
        return  # ``sglang serve`` normalizes its own argv: checked after SGLang parsed it
    argv = sys.argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        return
    parser = _Parser(prog=PROG, add_help=False)
    from sglang.srt.server_args import ServerArgs

    ServerArgs.add_cli_args(parser)
    _add_our_flags(parser)
    if "--config" in argv:
        from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

        try:
            argv = ConfigArgumentMerger(parser).merge_config_with_args(argv)
        except Exception:
            return  # SGLang reports a bad config file its own way
    # SGLang's parse warns about deprecated flags; it parses again right after this one.
    quiet = logging.getLogger("sglang.srt.arg_groups.argparse_actions")
    was, quiet.disabled = quiet.disabled, True
    try:
        if only_our_plugins():
            args = parser.parse_args(argv)
        else:
            args, _unknown = parser.parse_known_args(argv)
    finally:
        quiet.disabled = was
    try:
        check_namespace(args)
    except ConfigError as e:
        refuse(str(e))


def check_namespace(args: Any, *, launch: bool = True) -> None:
    """Every check the arguments allow before anything is loaded (raises ``ConfigError``).
    ``launch``: they start a server here (the CPU launch hint is for the command line, not for a
    program that parses arguments in code)."""
    from .checks import check_contradictions, check_server_args
    from .flags import BACKEND, check_options, options_from_namespace
    from .persistence import check_cache_file

    if launch:
        check_cpu_device(args)
    given = options_from_namespace(args)
    if getattr(args, "radix_cache_backend", None) != BACKEND:
        check_options_unused(given)
        return
    check_contradictions(args)
    check_server_args(args)
    check_options(given)
    check_cache_file(given.cache_file, given.host_cache_mib)
    check_l3(given)


def check_l3(opts: Any) -> None:
    """``--hybrid-l3``'s URL and its host tier, which the scheduler checks again after the model
    loaded (``l3_tier.setup``)."""
    if not opts.l3:
        return
    from ..store.l3.backend import L3ConfigError, parse_url

    try:
        parse_url(opts.l3)
    except L3ConfigError as e:
        raise ConfigError(str(e)) from None
    if opts.host_cache_mib == 0:
        raise ConfigError(
            f"--hybrid-l3 needs the host tier its entries are restored into, which "
            f"--hybrid-host-cache-mib 0 turns off: give the host tier a budget or drop "
            f"--hybrid-l3 {opts.l3}"
        )


def check_options_unused(opts: Any) -> None:
    """A cache flag without ``--radix-cache hybrid`` would be silently ignored."""
    from .flags import explicit_flags

    flags = explicit_flags(opts)
    if flags:
        raise ConfigError(
            f"{flags[0]} configures --radix-cache hybrid, which this launch does not select: "
            f"add --radix-cache hybrid, or drop {' '.join(flags)}"
        )


def check_cpu_device(args: Any) -> None:
    """``--device cpu`` runs either SGLang's CPU engine (``SGLANG_USE_CPU_ENGINE=1`` and
    sgl-kernel's CPU build) or our stand-in worker; with neither, SGLang's model code takes the
    CUDA path and fails minutes later with "Found no NVIDIA driver"."""
    if getattr(args, "device", None) != "cpu" or getattr(args, "hybrid_cpu_worker", None):
        return
    env = os.environ.get(CPU_ENGINE_ENV, "0") == "1"
    kernels = importlib.util.find_spec("sgl_kernel") is not None
    if env and kernels:
        return
    here = (
        "neither is set up here"
        if not (env or kernels)
        else ("sgl_kernel is not installed" if env else f"{CPU_ENGINE_ENV} is not 1")
    )
    raise ConfigError(
        f"--device cpu: SGLang's own CPU engine needs {CPU_ENGINE_ENV}=1 and sgl-kernel's CPU "
        f"build ({here}); to run the plugin's CPU worker instead (tests, demos: "
        f"docs/server.md), add {CPU_WORKER_FLAG} model"
    )


def only_our_plugins() -> bool:
    """Every installed SGLang plugin is ours, so this parser knows every flag there is."""
    from importlib.metadata import entry_points

    eps = list(entry_points(group="sglang.srt.plugins"))
    return bool(eps) and all((ep.dist.name if ep.dist else None) == OUR_DIST for ep in eps)


def _add_our_flags(parser: argparse.ArgumentParser) -> None:
    """The flags our plugins add through their ``add_cli_args`` hooks (unless the hooks are live
    already: in the launcher they are applied after ``register``)."""
    from ..cpu.plugin import _add_cli_args as add_cpu_worker_flag
    from .flags import add_cli_args

    have = parser._option_string_actions
    if "--radix-cache" not in have:
        add_cli_args(parser)
    if CPU_WORKER_FLAG not in have:
        add_cpu_worker_flag(None, parser)


class _Parser(argparse.ArgumentParser):
    """SGLang's parser with a one-line error: argparse's usage runs to a hundred lines, and a
    misspelt flag gets the nearest known one."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("unrecognized arguments:"):
            known = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
            hints = []
            for token in message.split(":", 1)[1].split():
                if token.startswith("--"):
                    near = difflib.get_close_matches(token.split("=")[0], known, n=1, cutoff=0.75)
                    if near:
                        hints.append(f"{token}: did you mean {near[0]}?")
            if hints:
                message += " (" + "; ".join(hints) + ")"
        sys.stderr.write(f"{self.prog}: error: {message} (see --help)\n")
        sys.stderr.flush()
        raise SystemExit(2)
