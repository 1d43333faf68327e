"""The metrics' vocabulary and rules without a server (issue #38): snapshot kinds named as the
boundary API names them, and why a request resumed short of its KV match."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang_hybrid.index import SnapshotKind, TapSource
from sglang_hybrid.index.match import Match
from sglang_hybrid.sglang import boundaries, kinds
from sglang_hybrid.sglang.metrics import SERIES, SHORT_REASONS, short_resume_reason


def test_every_tap_rule_has_a_kind_name() -> None:
    assert set(kinds.ORIGIN_NAMES) == set(TapSource)
    assert len(kinds.KINDS) == len(set(kinds.KINDS))


@pytest.mark.parametrize("kind", list(SnapshotKind))
@pytest.mark.parametrize("origin", [0, *[int(t) for t in TapSource]])
def test_the_api_and_the_metrics_name_a_snapshot_alike(kind: SnapshotKind, origin: int) -> None:
    """``boundaries._point`` (the API) and ``kinds.kind_name`` (the gauge's label) agree, and
    the name is one the gauge exports from the start."""
    s = SimpleNamespace(kind=kind, origin=origin, durable=False)
    point = SimpleNamespace(position=64, tier="device", snapshot=s)
    name = kinds.kind_name(s)
    assert boundaries._point(point)["kind"] == name
    assert name in kinds.KINDS


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
