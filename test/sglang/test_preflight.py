"""The command line's checks (``preflight.py``, issue #38) on parsed arguments: contradictory
flags, cache flags without the cache, option values, the CPU launch hint, misspelt flags."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from sglang_hybrid.index import ConfigError


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    from sglang.srt.server_args import ServerArgs

    from sglang_hybrid.sglang import preflight

    p = preflight._Parser(prog=preflight.PROG, add_help=False)
    ServerArgs.add_cli_args(p)
    preflight._add_our_flags(p)
    return p


CPU = ["--model-path", "/m", "--device", "cpu", "--hybrid-cpu-worker", "model"]


def check(parser: argparse.ArgumentParser, *argv: str, launch: bool = True) -> None:
    from sglang_hybrid.sglang.preflight import check_namespace

    check_namespace(parser.parse_args(list(argv)), launch=launch)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--radix-cache", "hybrid", "--disable-radix-cache"], r"--disable-radix-cache turns off"),
        (["--hybrid-host-cache-mib", "64"], r"--hybrid-host-cache-mib configures --radix-cache hy"),
        (["--no-hybrid-coalesce"], r"--no-hybrid-coalesce configures"),
        (["--radix-cache", "hybrid", "--hybrid-taps-per-request", "-1"], r"must be non-negative"),
        (["--radix-cache", "hybrid", "--hybrid-tap-ladder", "0"], r"--hybrid-tap-ladder must be"),
        (["--radix-cache", "hybrid", "--hybrid-host-cache-mib", "99999999"], r"this machine has"),
        (
            ["--radix-cache", "hybrid", "--hybrid-cache-file", "/no/such/dir/f"],
            r"--hybrid-cache-file /no/such/dir/f: the directory /no/such/dir does not exist",
        ),
        (
            ["--radix-cache", "hybrid", "--hybrid-host-cache-mib", "0", "--hybrid-cache-file", "f"],
            r"--hybrid-host-cache-mib 0 turns the host tier off",
        ),
        (
            [
                "--radix-cache",
                "hybrid",
                "--hybrid-host-cache-mib",
                "0",
                "--hybrid-host-order",
                "gdsf",
            ],
            r"--hybrid-host-order gdsf: --hybrid-host-cache-mib 0 turns the host tier off",
        ),
        (["--hybrid-host-order", "learned"], r"--hybrid-host-order configures --radix-cache hy"),
        (
            ["--radix-cache", "hybrid", "--hybrid-host-cache-mib", "0", "--hybrid-host-exclusive"],
            r"--hybrid-host-exclusive: --hybrid-host-cache-mib 0 turns the host tier off",
        ),
        (["--hybrid-host-exclusive"], r"--hybrid-host-exclusive configures --radix-cache hy"),
        (["--radix-cache", "hybrid", "--page-size", "48"], r"--page-size 48"),
        (["--radix-cache", "hybrid", "--hybrid-l3", "ftp://x"], r"--hybrid-l3"),
        (
            ["--radix-cache", "hybrid", "--hybrid-host-cache-mib", "0", "--hybrid-l3", "file:///t"],
            r"--hybrid-l3 needs the host tier",
        ),
    ],
)
def test_refused_at_parse(parser: argparse.ArgumentParser, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        check(parser, *CPU, *argv)


def test_accepted_launches(parser: argparse.ArgumentParser, tmp_path: Path) -> None:
    check(parser, *CPU)  # SGLang's own cache
    check(parser, *CPU, "--disable-radix-cache")  # no cache at all
    check(
        parser,
        *CPU,
        "--radix-cache",
        "hybrid",
        "--hybrid-host-cache-mib",
        "64",
        "--hybrid-cache-file",
        str(tmp_path / "c"),
        "--hybrid-host-order",
        "gdsf",
        "--hybrid-host-exclusive",
    )
    check(parser, *CPU, "--radix-cache", "hybrid", "--no-hybrid-host-exclusive")
    with pytest.raises(SystemExit):  # argparse's own error: not one of the choices
        check(parser, *CPU, "--radix-cache", "hybrid", "--hybrid-host-order", "lru")


def test_a_cpu_launch_without_the_worker_says_how(
    parser: argparse.ArgumentParser, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("SGLANG_USE_CPU_ENGINE", raising=False)
    argv = ["--model-path", "/m", "--device", "cpu", "--radix-cache", "hybrid"]
    with pytest.raises(ConfigError, match=r"--device cpu: .*add --hybrid-cpu-worker model"):
        check(parser, *argv)
    check(parser, *argv, launch=False)  # a program parsing arguments: no launch, no hint
    check(parser, "--model-path", "/m", "--radix-cache", "hybrid")  # a GPU launch


def test_a_misspelt_flag_is_one_line_with_the_nearest(
    parser: argparse.ArgumentParser, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parser.parse_args([*CPU, "--hybrid-host-cache-mb", "64"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "did you mean --hybrid-host-cache-mib?" in err, err


def test_pytest_is_not_a_launch() -> None:
    from sglang_hybrid.sglang.preflight import from_cli, preflight

    assert not from_cli()
    preflight()  # returns: this process does not run the server command line
