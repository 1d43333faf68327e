"""The plugin as a user reaches it: entry point, CLI flags, startup refusals, startup log."""

from __future__ import annotations

import logging
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path

import pytest

from sglang_hybrid.index import ConfigError


def test_entry_point_registers_the_backend_idempotently() -> None:
    from sglang.srt.mem_cache.registry import registered_radix_cache_backends

    (ep,) = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "sglang_hybrid"]
    register = ep.load()
    register()
    register()  # every spawned SGLang process calls it again
    assert "hybrid" in registered_radix_cache_backends()


def test_cli_alias_and_flags_reach_server_args(qwen3_next_dir: Path) -> None:
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(
        [
            "--model-path",
            str(qwen3_next_dir),
            "--radix-cache",
            "hybrid",
            "--hybrid-taps-per-request",
            "3",
            "--hybrid-device-snapshot-slots",
            "5",
            "--hybrid-host-cache-mib",
            "0",
            "--hybrid-tail-tap",
            "flexible",
        ]
    )
    assert sa.radix_cache_backend == "hybrid"
    opts = sa._hybrid_options
    assert (
        opts.taps_per_request,
        opts.device_snapshot_slots,
        opts.host_cache_mib,
        opts.tail_tap,
    ) == (3, 5, 0, "flexible")
    import pickle

    again = pickle.loads(pickle.dumps(sa))  # what the scheduler process receives
    assert again._hybrid_options.taps_per_request == 3


def test_launch_server_help_lists_the_flags() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for flag in (
        "--radix-cache ",
        "--hybrid-device-snapshot-slots",
        "--hybrid-taps-per-request",
        "--hybrid-tap-ladder",
        "--hybrid-tap-min-gap",
        "--hybrid-host-cache-mib",
        "--hybrid-tail-tap",
    ):
        assert flag in out.stdout, flag


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--page-size", "48"], r"--page-size 48: .*divid"),
        (
            ["--enable-hierarchical-cache"],
            r"--enable-hierarchical-cache: .*--hybrid-host-cache-mib",
        ),
        (
            ["--mamba-radix-cache-strategy", "extra_buffer"],
            r"use --mamba-radix-cache-strategy no_buffer",
        ),
        (["--enable-int8-mamba-checkpoint"], r"--enable-int8-mamba-checkpoint"),
    ],
)
def test_bad_configurations_fail_at_startup_naming_the_flag(
    qwen3_next_dir: Path, extra: list[str], message: str
) -> None:
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(
        ["--model-path", str(qwen3_next_dir), "--radix-cache", "hybrid", "--device", "cpu", *extra]
    )
    with pytest.raises((ConfigError, ValueError, AssertionError), match=message):
        sa.resolve_once()


def test_a_model_without_recurrent_layers_is_refused() -> None:
    from sglang_hybrid.sglang.checks import check_pools

    with pytest.raises(ConfigError, match=r"no recurrent layers.*drop --radix-cache hybrid"):
        check_pools(
            is_hybrid_ssm=False,
            mamba_slots=0,
            max_running=4,
            snapshot_slots=5,
            arch="Qwen3ForCausalLM",
        )


def test_too_few_state_slots_name_the_fix(build) -> None:
    with pytest.raises(ConfigError, match=r"raise --max-mamba-cache-size to 14"):
        build(running=4, mamba=10, opts={"device_snapshot_slots": 10})


def test_effective_values_are_logged_once_at_startup(build, caplog) -> None:
    caplog.set_level(logging.INFO, logger="sglang_hybrid.sglang.plugin")
    build(running=4, mamba=16)
    lines = [r.message for r in caplog.records if "sglang-hybrid cache" in r.message]
    assert len(lines) == 1
    # Every MambaPool slot beyond the 4 running requests and one admission in flight (16 - 5),
    # which is more than the spec's C + 2; 2 taps per request without a host tier.
    assert "11 device snapshot slots, 2 taps/request" in lines[0]
