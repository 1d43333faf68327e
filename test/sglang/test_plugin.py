"""The plugin as a user reaches it: entry point, CLI flags, startup refusals, startup log."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from collections.abc import Iterator
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


class PluginLog(logging.Handler):
    """The plugin logger's records (``prepare_server_args`` resets the root logger's handlers,
    which removes pytest's ``caplog``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def choices(self) -> list[tuple[int, str]]:
        """(level, what) of each choice the plugin logged for the operator."""
        prefix = "--radix-cache hybrid:"
        return [
            (r.levelno, r.getMessage()[len(prefix) :].split(":")[0].strip())
            for r in self.records
            if r.getMessage().startswith(prefix)
        ]


@pytest.fixture
def plugin_log() -> Iterator[PluginLog]:
    logger = logging.getLogger("sglang_hybrid.sglang.plugin")
    handler, level = PluginLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def hybrid_args(model: Path, *extra: str) -> list[str]:
    # --device cpu: this machine has no accelerator; on a GPU the command has no device flag.
    return ["--model-path", str(model), "--radix-cache", "hybrid", "--device", "cpu", *extra]


@pytest.mark.parametrize("page", [None, "64"])
def test_the_launch_command_alone_starts_with_the_plugin_choices_logged_once(
    qwen3_next_dir: Path, plugin_log: PluginLog, page: str | None
) -> None:
    """``--radix-cache hybrid`` and nothing else: the plugin picks the no_buffer strategy where the
    operator did not choose and leaves overlap scheduling on (SGLang's default), SGLang's own
    validation accepts both (no_buffer at page 64 and with overlap too), and the scheduler's
    pickled copy carries them."""
    import pickle

    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(hybrid_args(qwen3_next_dir, *(["--page-size", page] if page else [])))
    sa.resolve_once()
    # What the operator typed stays as typed; the choice is a resolution declaration.
    assert (sa.disable_overlap_schedule, sa.mamba_radix_cache_strategy) == (False, "auto")
    again = pickle.loads(pickle.dumps(sa))  # what each scheduler process receives
    again.resolve_once()  # a resolved record: nothing chosen or logged again
    for record in (sa, again):
        assert resolution_result(record, "disable_overlap_schedule") is False
        assert resolution_result(record, "mamba_radix_cache_strategy") == "no_buffer"
    # The config bags the scheduler reads (get_schedule(), get_exec()) are projected from it.
    ctx = create_context(again, role="scheduler")
    assert ctx.config_bag("schedule").disable_overlap_schedule is False
    assert ctx.config_bag("exec").mamba.mamba_radix_cache_strategy == "no_buffer"
    assert plugin_log.choices() == [(logging.INFO, "--mamba-radix-cache-strategy no_buffer")]


def test_explicit_choices_are_kept_and_nothing_is_logged(
    qwen3_next_dir: Path, plugin_log: PluginLog
) -> None:
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args

    explicit = ["--disable-overlap-schedule", "--mamba-radix-cache-strategy", "no_buffer"]
    sa = prepare_server_args(hybrid_args(qwen3_next_dir, *explicit))
    sa.resolve_once()
    assert resolution_result(sa, "disable_overlap_schedule") is True
    assert plugin_log.choices() == []


# One case per startup refusal: what the operator asked for that the cache cannot honour, refused
# before SGLang resolves anything, with our message naming the flag and the fix.
REFUSALS = [
    (["--page-size", "48"], r"--page-size 48: .*divid"),
    (["--enable-hierarchical-cache"], r"--enable-hierarchical-cache: .*--hybrid-host-cache-mib"),
    (["--hicache-storage-backend", "file"], r"--hicache-storage-backend: .*drop the flag"),
    (["--mamba-radix-cache-strategy", "extra_buffer"], r"use --mamba-radix-cache-strategy no_buf"),
    (["--mamba-radix-cache-strategy", "extra_buffer_lazy"], r"extra_buffer_lazy: .*no_buffer"),
    (["--enable-int8-mamba-checkpoint"], r"--enable-int8-mamba-checkpoint: .*drop the flag"),
    (["--enable-kv-cache-sharding"], r"--enable-kv-cache-sharding: .*drop the flag"),
    (["--enable-unified-cache-external-linker"], r"--enable-unified-cache-external-linker: drop"),
    (["--enable-unified-memory"], r"--enable-unified-memory: .*strided state views.*drop the flag"),
    (["--kv-cache-dtype", "nvfp4"], r"--kv-cache-dtype nvfp4: .*per-token scale.*fp8_e4m3"),
    (["--kv-cache-dtype", "fp4_mx_block16"], r"--kv-cache-dtype fp4_mx_block16: .*per-token"),
    (["--kv-cache-dtype", "mxfp8"], r"--kv-cache-dtype mxfp8: .*per-token scale"),
    (["--enable-linear-replayssm"], r"--enable-linear-replayssm: .*ReplaySSM ring.*drop the flag"),
    (["--disaggregation-mode", "prefill"], r"--disaggregation-mode prefill: PD disaggregation"),
    (["--disaggregation-mode", "decode"], r"--disaggregation-mode decode: .*drop"),
    (
        ["--speculative-algorithm", "NGRAM"],
        r"--speculative-algorithm NGRAM: not supported .*EAGLE, EAGLE3, NEXTN.*or drop it",
    ),
    (["--speculative-algorithm", "STANDALONE"], r"--speculative-algorithm STANDALONE: not support"),
    (["--pp-size", "2"], r"--pp-size > 1: not supported"),
]


@pytest.mark.parametrize(("extra", "message"), REFUSALS, ids=[" ".join(e) for e, _ in REFUSALS])
def test_bad_configurations_fail_at_startup_naming_the_flag(
    qwen3_next_dir: Path, extra: list[str], message: str
) -> None:
    """Refused as the arguments are parsed (issue #38: before, at resolution, after the plugin's
    imports); a record built in code (an ``Engine``) is refused when SGLang resolves it."""
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(ConfigError, match=message):
        prepare_server_args(hybrid_args(qwen3_next_dir, *extra))
    sa = prepare_server_args(hybrid_args(qwen3_next_dir))
    bad = prepare_server_args(["--model-path", str(qwen3_next_dir), "--device", "cpu", *extra])
    for f in _changed_fields(bad):  # the flag's fields, set on a record built without it
        setattr(sa, f, getattr(bad, f))
    with pytest.raises(ConfigError, match=message):
        sa.resolve_once()


def _changed_fields(sa: object) -> list[str]:
    """Fields of ``sa`` that differ from a record parsed from the bare launch command."""
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    base = prepare_server_args(["--model-path", str(sa.model_path), "--device", "cpu"])
    return [
        name
        for name in ServerArgs.__struct_fields__
        if name != "radix_cache_backend" and getattr(sa, name) != getattr(base, name)
    ]


def test_the_page_major_kv_environment_variable_is_refused(
    qwen3_next_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setenv("SGLANG_USE_HND_KVCACHE", "1")
    with pytest.raises(ConfigError, match=r"SGLANG_USE_HND_KVCACHE=1: .*unset"):
        prepare_server_args(hybrid_args(qwen3_next_dir))


def test_fp8_kv_with_per_tensor_scales_is_accepted(qwen3_next_dir: Path) -> None:
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(hybrid_args(qwen3_next_dir, "--kv-cache-dtype", "fp8_e4m3"))
    sa.resolve_once()
    assert resolution_result(sa, "kv_cache_dtype") == "fp8_e4m3"


def test_overlap_scheduling_and_the_prefill_delayer_are_accepted(qwen3_next_dir: Path) -> None:
    """Overlap scheduling is on unless the operator turns it off, and the prefill delayer (which
    needs it) starts: the cache captures pass ends as part of the pass (test_overlap.py)."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args

    sa = prepare_server_args(hybrid_args(qwen3_next_dir, "--enable-prefill-delayer"))
    sa.resolve_once()
    assert resolution_result(sa, "disable_overlap_schedule") is False


@pytest.mark.parametrize(
    ("pool", "message"),
    [
        ({"kv_cache_layout": "hnd", "use_hnd": True}, r"'hnd' layout.*SGLANG_USE_HND_KVCACHE"),
        ({"kv_cache_layout": "page_major"}, r"'page_major' layout"),
        ({"k_scale_buffer": [0], "v_scale_buffer": [0]}, r"per-token scales \(k_scale_buffer"),
    ],
)
def test_a_kv_pool_the_cache_cannot_copy_is_refused_at_build(pool: dict, message: str) -> None:
    """Whatever flag or platform default led to it, the pool SGLang built is checked too."""
    from types import SimpleNamespace

    from sglang_hybrid.sglang.checks import check_kv_pool

    check_kv_pool(SimpleNamespace(full_kv_pool=SimpleNamespace(kv_cache_layout="nhd")))
    with pytest.raises(ConfigError, match=message):
        check_kv_pool(SimpleNamespace(full_kv_pool=SimpleNamespace(**pool)))


@pytest.fixture
def scratch_hooks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Registrations made in the test are dropped afterwards."""
    from collections import defaultdict

    from sglang.srt.plugins.hook_registry import HookRegistry

    copy = defaultdict(list, {t: list(h) for t, h in HookRegistry._hooks.items()})
    monkeypatch.setattr(HookRegistry, "_hooks", copy)


def test_a_hook_sglang_could_not_apply_stops_the_launch(
    qwen3_next_dir: Path, scratch_hooks: None, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang logs and skips a hook whose target it cannot resolve; the plugin refuses to start,
    naming the target (here: what a rename of ``PrefillAdder.add_chunked_req`` would do)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType
    from sglang.srt.server_args import prepare_server_args

    from sglang_hybrid.sglang import chunking

    target = "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_request"
    HookRegistry.register(target, chunking.after_add_chunked_req, HookType.AFTER)
    HookRegistry.apply_hooks()  # as in load_plugins: the failure is only logged
    assert any("Failed to apply hooks to " + target in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match=re.escape(target) + r" \(not applied"):
        prepare_server_args(hybrid_args(qwen3_next_dir))  # at the CLI already
    sa = prepare_server_args(["--model-path", str(qwen3_next_dir), "--device", "cpu"])
    sa.radix_cache_backend = "hybrid"  # a record built in code (Engine): at resolution
    with pytest.raises(ConfigError, match=re.escape(target)):
        sa.resolve_once()


def test_a_hook_undone_after_sglang_applied_it_stops_the_scheduler(
    build, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler checks the live attributes when it builds the cache: a target whose wrapper
    is gone (replaced after the patch) is named too."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    target = "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req"
    monkeypatch.setattr(PrefillAdder, "add_chunked_req", PrefillAdder.add_chunked_req.__wrapped__)
    with pytest.raises(ConfigError, match=re.escape(target) + r" \(applied, then replaced\)"):
        build()


def test_empty_prompts_are_refused_where_sglang_refuses_input_ids_empty() -> None:
    """The hooks themselves (``test/server`` sends every shape to a real server): SGLang's own
    normalization now refuses them, a session continuation is left to SGLang, and a prompt that
    tokenizes to nothing is caught at SGLang's per-request validation."""
    from sglang.srt.managers.io_struct import GenerateReqInput

    from sglang_hybrid.sglang.prompts import before_normalize, before_validate_one

    with pytest.raises(ValueError, match=r"^text\[1\] is empty: a prompt needs at least one"):
        GenerateReqInput(text=["hi", ""]).normalize_batch_and_arguments()
    with pytest.raises(ValueError, match=r"^input_ids cannot be empty"):  # SGLang's own words
        GenerateReqInput(input_ids=[]).normalize_batch_and_arguments()
    with pytest.raises(ValueError, match=r"input_embeds\[1\] is empty"):
        before_normalize(GenerateReqInput(input_embeds=[[[0.5]], []]))
    before_normalize(GenerateReqInput(input_ids=[], session_params={"id": "s"}))
    before_normalize(GenerateReqInput(text=["a", "b"], input_ids=[[1], [2]]))
    with pytest.raises(ValueError, match=r"no tokens once tokenized"):
        before_validate_one(None, GenerateReqInput(text="\u200b"), [])
    before_validate_one(None, GenerateReqInput(input_ids=[], session_params={"id": "s"}), [])


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


def test_the_cpu_speculative_algorithm_is_accepted_with_eagle_defaults(
    qwen3_next_dir: Path,
) -> None:
    """``CPU_MTP`` (the CPU workers' algorithm, issue #14) passes the cache's checks and gets a
    topk-1 chain's defaults when the operator gives none."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args

    from sglang_hybrid.cpu.spec_register import register_algorithm

    register_algorithm()
    args = ["--speculative-algorithm", "CPU_MTP", "--disable-overlap-schedule"]
    sa = prepare_server_args(hybrid_args(qwen3_next_dir, *args))
    sa.resolve_once()
    got = {
        name: resolution_result(sa, name)
        for name in (
            "speculative_num_steps",
            "speculative_eagle_topk",
            "speculative_num_draft_tokens",
        )
    }
    assert got == {
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
    }


@pytest.mark.parametrize("algo", ["NEXTN", "EAGLE"])
@pytest.mark.parametrize("overlap", [False, True])
def test_mtp_is_accepted(qwen3_next_dir: Path, algo: str, overlap: bool) -> None:
    """SGLang's MTP / EAGLE algorithms pass the cache's checks, with overlap scheduling or
    without (the draft's KV pool moves with the target's, ``draft.py``; SGLang's speculative
    scheduler path under both is in test_speculative.py). SGLang resolves NEXTN to EAGLE (and,
    on ``--device cpu`` only, turns overlap off for it). Whether SGLang's EAGLE
    worker then serves them is a GPU question (``docs/sglang-backend.md``: unverified)."""
    from sglang.srt.arg_groups.overrides import resolution_result
    from sglang.srt.server_args import prepare_server_args

    args = ["--speculative-algorithm", algo]
    if not overlap:
        args.append("--disable-overlap-schedule")
    sa = prepare_server_args(hybrid_args(qwen3_next_dir, *args))
    sa.resolve_once()
    assert resolution_result(sa, "speculative_algorithm") == "EAGLE"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--speculative-eagle-topk", "2"], r"CPU_MTP drafts a chain: --speculative-eagle-topk"),
        (
            ["--speculative-num-steps", "3", "--speculative-num-draft-tokens", "6"],
            r"--speculative-num-draft-tokens must be --speculative-num-steps \+ 1 \(4\)",
        ),
    ],
)
def test_the_cpu_speculative_algorithm_refuses_trees(
    qwen3_next_dir: Path, extra: list[str], message: str
) -> None:
    from sglang.srt.server_args import prepare_server_args

    from sglang_hybrid.cpu.spec_register import register_algorithm

    register_algorithm()
    args = ["--speculative-algorithm", "CPU_MTP", "--disable-overlap-schedule", *extra]
    sa = prepare_server_args(hybrid_args(qwen3_next_dir, *args))
    with pytest.raises(ValueError, match=message):
        sa.resolve_once()
