import json
from pathlib import Path

import numpy as np
import pytest

from sglang_hybrid.replay.errors import TraceFormatError
from sglang_hybrid.replay.traces.mooncake import BLOCK_TOKENS, load_mooncake

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared/traces/mooncake_synthetic_trace.jsonl"


def write(tmp_path, rows, name="t.jsonl"):
    p = tmp_path / name
    p.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return p


def row(ts, n, out, ids):
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


def test_blocks_are_deterministic_per_hash_id(tmp_path):
    p = write(tmp_path, [row(0, 3 * 512, 4, [1, 2, 3]), row(5, 2 * 512, 4, [9, 2])])
    a, b = load_mooncake(p).requests
    # Same id at any position, same 512 tokens; different ids differ.
    assert np.array_equal(a.input_ids[512:1024], b.input_ids[512:1024])
    assert not np.array_equal(a.input_ids[:512], b.input_ids[:512])
    again = load_mooncake(p).requests
    assert np.array_equal(again[0].input_ids, a.input_ids)
    other_seed = load_mooncake(p, seed=1).requests
    assert not np.array_equal(other_seed[0].input_ids, a.input_ids)
    assert a.input_ids.min() >= 0 and a.input_ids.max() < 2048


def test_last_block_cut_to_length_and_private_when_partial(tmp_path):
    rows = [
        row(0, 512 + 100, 2, [4, 5]),  # partial last block
        row(1, 512 + 100, 2, [4, 5]),  # the same ids and length again
        row(2, 2 * 512, 2, [4, 5]),  # block 5 complete
        row(3, 3 * 512, 2, [4, 5, 6]),
    ]
    a, b, c, d = load_mooncake(write(tmp_path, rows)).requests
    assert [r.n for r in (a, b, c, d)] == [612, 612, 1024, 1536]
    assert np.array_equal(a.input_ids[:512], b.input_ids[:512])
    # The partial last blocks are each request's own, not block 5 cut down.
    assert not np.array_equal(a.input_ids[512:], b.input_ids[512:])
    assert not np.array_equal(a.input_ids[512:], c.input_ids[512:612])
    # A full last block is shared like any other.
    assert np.array_equal(c.input_ids, d.input_ids[:1024])


def test_arrivals_and_limit(tmp_path):
    p = write(tmp_path, [row(0, 10, 1, [1]), "", row(1500, 20, 3, [2]), row(4000, 5, 1, [3])])
    t = load_mooncake(p, time_scale=2.0, limit=2)
    assert [r.arrival_s for r in t.requests] == [0.0, 3.0]
    assert [r.output_len for r in t.requests] == [1, 3]


@pytest.mark.parametrize(
    "bad, reason",
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "Expected `object`, got `array`"),
        (json.dumps({"timestamp": 0, "input_length": 3, "output_length": 1}), "field `hash_ids`"),
        (json.dumps(row(-1, 3, 1, [1])), "timestamp = -1: Expected `float` >= 0.0"),
        (json.dumps(row("0", 3, 1, [1])), 'timestamp = "0": Expected `float`, got `str`'),
        (json.dumps(row(0, 0, 1, [1])), "input_length = 0: Expected `int` >= 1"),
        (json.dumps(row(0, 3.0, 1, [1])), "input_length = 3.0: Expected `int`, got `float`"),
        (json.dumps(row(0, 3, 0, [1])), "output_length = 0"),
        (json.dumps(row(0, 3, 1, [])), "hash_ids = []: Expected `array` of length >= 1"),
        (json.dumps(row(0, 3, 1, [-4])), "hash_ids[0] = -4: Expected `int` >= 0"),
        (json.dumps(row(0, 3, 1, [True])), "hash_ids[0] = true: Expected `int`, got `bool`"),
        (json.dumps(row(0, 515, 1, [1, 1 << 62])), "hash_ids[1] = 4611686018427387904"),
        (json.dumps(row(0, 600, 1, [1])), "cannot hold"),
        (json.dumps(row(0, 512, 1, [1, 2])), "cannot hold"),
    ],
)
def test_malformed_line_names_file_line_and_reason(tmp_path, bad, reason):
    p = write(tmp_path, [row(0, 10, 1, [1]), "", bad, row(0, 10, 1, [1])])
    with pytest.raises(TraceFormatError) as e:
        load_mooncake(p)
    assert e.value.line == 3  # blank lines count
    assert e.value.path == str(p)
    assert reason in e.value.reason
    assert str(e.value).startswith(f"{p}:3: ")


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Mooncake trace is absent")
def test_the_shared_trace_loads_with_its_lengths():
    t = load_mooncake(SHARED_TRACE, limit=50)
    raw = [json.loads(x) for x in SHARED_TRACE.read_text().splitlines()[:50]]
    assert [r.n for r in t.requests] == [x["input_length"] for x in raw]
    assert [r.arrival_s for r in t.requests] == [x["timestamp"] / 1000 for x in raw]
    assert all(len(x["hash_ids"]) == -(-x["input_length"] // BLOCK_TOKENS) for x in raw)
