"""The metrics' vocabulary and rules without a server (issue #38): snapshot kinds named as the
boundary API names them, and why a request resumed short of its KV match."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_hybrid.index import SnapshotKind, TapSource
from sglang_hybrid.index import checkpoint_kinds as kinds
from sglang_hybrid.index.match import Match
from sglang_hybrid.sglang import boundaries
from sglang_hybrid.sglang.metrics import SERIES, SHORT_REASONS, short_resume_reason


def test_every_tap_rule_has_a_kind_name() -> None:
    assert set(kinds.SOURCE_NAMES) == set(TapSource)
    assert len(kinds.CHECKPOINT_KINDS) == len(set(kinds.CHECKPOINT_KINDS))


@pytest.mark.parametrize("kind", list(SnapshotKind))
@pytest.mark.parametrize("origin", [0, *[int(t) for t in TapSource]])
def test_the_api_and_the_metrics_name_a_snapshot_alike(kind: SnapshotKind, origin: int) -> None:
    """``boundaries._point`` (the API) and ``checkpoint_kind`` (the gauge's label) agree, and
    the name is one the gauge exports from the start."""
    s = SimpleNamespace(kind=kind, origin=origin, durable=False)
    point = SimpleNamespace(position=64, tier="device", snapshot=s)
    name = kinds.checkpoint_kind(s.kind, s.origin)
    assert boundaries._point(point)["kind"] == name
    assert name in kinds.CHECKPOINT_KINDS


def test_series_measure_one_quantity_each() -> None:
    for s in SERIES:
        assert s.type in ("counter", "gauge")
        assert s.type != "counter" or s.name.endswith("_total"), s.name
        assert all(len(v) == len(s.labels) for v in s.values), s.name
        assert "state" not in s.labels, s.name  # used/capacity in one metric (issue #38)
        assert len(s.help) > 40 and "The hybrid cache's" not in s.help, s.name


def _node(h: int) -> SimpleNamespace:
    return SimpleNamespace(lookup_hash=h)


def _snap(frontier: int, *, on_device: bool) -> SimpleNamespace:
    return SimpleNamespace(frontier=frontier, complete_on_device=on_device)


def _handle(
    blocks: int, resumed: int, best: object = None, settled: int | None = None
) -> SimpleNamespace:
    path = [_node(100 + b) for b in range(blocks)]
    k = len(path)
    m = Match(64 * k + 10, path, k, k if settled is None else settled, best, None, None)
    return SimpleNamespace(match=m, prefix_len=resumed)


STATE = SimpleNamespace(no_host=False)


def test_no_shortfall() -> None:
    assert short_resume_reason(_handle(4, 256), STATE) is None
    assert short_resume_reason(_handle(4, 300), STATE) is None  # past the match: a tail
    assert short_resume_reason(SimpleNamespace(match=None, prefix_len=0), STATE) is None


@pytest.mark.parametrize(
    ("handle", "state", "seen", "want"),
    [
        (_handle(5, 64), STATE, set(), ("no_state", 256)),
        (_handle(5, 64), STATE, {103}, ("evicted", 256)),  # block 3 anchored a snapshot once
        (_handle(5, 64), STATE, {99}, ("no_state", 256)),  # not on this path
        (_handle(5, 0, _snap(200, on_device=False)), STATE, set(), ("restore_declined", 320)),
        (
            _handle(5, 0, _snap(200, on_device=False)),
            SimpleNamespace(no_host=True),
            set(),
            ("restore_failed", 320),
        ),
        (_handle(5, 0, _snap(200, on_device=True)), STATE, set(), ("no_state_slot", 320)),
        (_handle(5, 128, None, settled=3), STATE, set(), ("in_flight", 192)),
    ],
)
def test_why_a_request_resumed_short(handle, state, seen, want) -> None:
    got = short_resume_reason(handle, state, seen)
    assert got == want
    assert got[0] in SHORT_REASONS


def test_l3_series_mirror_the_l3_counters() -> None:
    """The L3 series follow the cache's agreed L3 counters and the rank's own (a fake cache with
    the L3 tier's counter names; a private registry): lookups split into hit / miss, refusals
    by reason, l3_up from the breaker; and they advance by the change, as the others do."""
    from prometheus_client import CollectorRegistry

    from sglang_hybrid.sglang.l3_tier import L3Counters, LocalCounters
    from sglang_hybrid.sglang.metrics import PREFIX, CacheMetrics

    agreed = {f"l3_{k}": 0 for k in L3Counters.__dataclass_fields__}
    local = {f"l3_{k}": 0 for k in LocalCounters.__dataclass_fields__}
    local.update(l3_on=1, l3_offs=0, l3_put_bytes=0)

    class L3:
        def local_stats(self) -> dict[str, int]:
            return dict(local)

    slots = SimpleNamespace(n=4, free=4)
    cache = SimpleNamespace(
        l3=L3(),
        stats=lambda: dict(agreed),
        index=SimpleNamespace(slots=slots, host=None, snapshots={}),
    )
    reg = CollectorRegistry()
    m = CacheMetrics({"tp_rank": 0}, registry=reg)

    def value(name: str, **labels: str) -> float:
        v = reg.get_sample_value(
            PREFIX + name, {"model_name": m.labels["model_name"], "tp_rank": "0", **labels}
        )
        assert v is not None, (name, labels)
        return v

    m.refresh(cache)
    assert value("l3_up") == 1 and value("l3_lookups_total", result="miss") == 0
    agreed.update(l3_lookups=5, l3_lookup_hits=2, l3_skipped_off=1, l3_fetches_landed=2)
    agreed.update(l3_fetched_tokens=640, l3_waited_connect=1)
    local.update(l3_on=0, l3_offs=1, l3_put_bytes=4096, l3_refused_corrupt=1)
    m.refresh(cache)
    assert value("l3_lookups_total", result="hit") == 2
    assert value("l3_lookups_total", result="miss") == 3
    assert value("l3_lookups_total", result="skipped_off") == 1
    assert value("l3_fetches_total", result="landed") == 2
    assert value("l3_fetched_tokens_total") == 640
    assert value("l3_first_connect_waits_total") == 1
    assert value("l3_written_bytes_total") == 4096
    assert value("l3_refused_objects_total", reason="corrupt") == 1
    assert value("l3_refused_objects_total", reason="foreign") == 0
    assert value("l3_off_events_total") == 1 and value("l3_up") == 0
    agreed.update(l3_lookups=6)
    m.refresh(cache)  # advances by the change only
    assert value("l3_lookups_total", result="miss") == 4
    assert value("l3_lookups_total", result="hit") == 2
