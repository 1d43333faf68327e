import json

import numpy as np
import pytest

from sglang_hybrid.replay.errors import TraceFormatError
from sglang_hybrid.replay.traces.sessions import load_sessions, write_sessions


def write(tmp_path, rows):
    p = tmp_path / "s.jsonl"
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


FIRST = {"rid": "a", "input_ids": [20, 21, 22], "output_length": 2, "arrival_ms": 0}


def test_round_trip_of_a_generated_workload(tmp_path, small_agent_trace):
    p = write_sessions(small_agent_trace, tmp_path / "agent.jsonl")
    back = load_sessions(p)
    assert len(back.requests) == len(small_agent_trace.requests)
    for a, b in zip(small_agent_trace.requests, back.requests):
        assert (a.rid, a.after, a.session, a.turn, a.tag) == (
            b.rid,
            b.after,
            b.session,
            b.turn,
            b.tag,
        )
        assert np.array_equal(a.input_ids, b.input_ids)
        assert np.array_equal(a.output_ids, b.output_ids)
        assert (a.hint_positions, a.hint_kinds) == (b.hint_positions, b.hint_kinds)
        assert a.delay_s == pytest.approx(b.delay_s)
        assert (a.arrival_s is None) == (b.arrival_s is None)
        if a.arrival_s is not None:
            assert a.arrival_s == pytest.approx(b.arrival_s)


def test_fields_are_read(tmp_path):
    rows = [
        FIRST,
        {
            "rid": "b",
            "session": "s",
            "turn": 1,
            "tag": "tool_step",
            "after": ["a"],
            "delay_ms": 1500,
            "input_ids": [20, 21, 22, 23],
            "output_ids": [30, 31, 2],
            "hints": {"positions": [2, 4], "kinds": ["message", "opener"]},
        },
    ]
    a, b = load_sessions(write(tmp_path, rows)).requests
    assert a.arrival_s == 0.0 and a.output_len == 2 and a.output_ids is None
    assert b.after == ("a",) and b.delay_s == 1.5 and b.output_len == 3
    assert b.hint_positions == (2, 4) and b.hint_kinds == ("message", "opener")
    assert (b.session, b.turn, b.tag) == ("s", 1, "tool_step")


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("nope", "not JSON"),
        ({"input_ids": [1], "output_length": 1, "arrival_ms": 0}, "missing required field `rid`"),
        ([FIRST], "Expected `object`, got `array`"),
        ({**FIRST, "rid": 7}, "rid = 7: Expected `str`"),
        ({**FIRST, "rid": "a"}, "duplicate rid"),
        ({**FIRST, "rid": "b", "input_ids": [1, 5000]}, "outside the vocabulary"),
        ({**FIRST, "rid": "b", "input_ids": []}, "input_ids = []: Expected `array` of length >= 1"),
        ({**FIRST, "rid": "b", "input_ids": [1, True]}, "input_ids[1] = true: Expected `int`"),
        ({**FIRST, "rid": "b", "input_ids": [1, 2.5]}, "input_ids[1] = 2.5: Expected `int`"),
        ({**FIRST, "rid": "b", "output_ids": [3]}, "exactly one of output_ids"),
        ({**FIRST, "rid": "b", "after": "a"}, "exactly one of arrival_ms"),
        ({"rid": "b", "input_ids": [1], "output_length": 1, "after": "zz"}, "no earlier line"),
        ({"rid": "b", "input_ids": [1], "output_length": 1, "after": []}, "after = []"),
        ({**FIRST, "rid": "b", "arrival_ms": -1}, "arrival_ms = -1: Expected `float` >= 0.0"),
        ({**FIRST, "rid": "b", "delay_ms": 3}, "delay_ms needs after"),
        ({**FIRST, "rid": "b", "hints": {"positions": [9], "kinds": ["opener"]}}, "outside (0, 3]"),
        ({**FIRST, "rid": "b", "hints": {"positions": [1], "kinds": ["foo"]}}, "hint kind"),
        ({**FIRST, "rid": "b", "hints": {"positions": [1], "kinds": []}}, "equal length"),
        ({**FIRST, "rid": "b", "hints": {"kinds": [], "at": 1}}, "unknown field `at`"),
        ({**FIRST, "rid": "b", "colour": "red"}, "unknown field"),
        ({**FIRST, "rid": "b", "output_length": 0}, "output_length = 0: Expected `int` >= 1"),
        ({**FIRST, "rid": "b", "turn": -2}, "turn = -2"),
        ({**FIRST, "rid": "b", "session": ""}, 'session = ""'),
    ],
)
def test_malformed_line_names_file_line_and_reason(tmp_path, bad, reason):
    p = write(tmp_path, [FIRST, "", bad])
    with pytest.raises(TraceFormatError) as e:
        load_sessions(p)
    assert e.value.line == 3
    assert e.value.path == str(p)
    assert reason in e.value.reason, e.value.reason


def test_a_bad_field_is_named_with_its_value(tmp_path):
    p = write(tmp_path, [FIRST, {**FIRST, "rid": "b", "delay_ms": "soon", "after": "a"}])
    with pytest.raises(TraceFormatError) as e:
        load_sessions(p)
    assert str(e.value) == f'{p}:2: delay_ms = "soon": Expected `float`, got `str`'
