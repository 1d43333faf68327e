"""A subset of each scheduler suite under the CPU stream model, in CI (issue #35).

The tests are the suites' own, called with a ``build`` that runs every hybrid-cache scheduler
under a fresh ``StreamModel`` (``stream_model_build.py``): SGLang's schedule, forward and copy
streams emulated, its WAR barrier on, the cache in its CUDA branches, and a budget on each of the
cache's per-pass entry points where a host sync fails. A race, a free without ``record_stream``
or a host sync fails the test where it happens; each test still checks its outputs as in its
suite (the checking worker proves every resumed KV and state against an uncached run).

Which ones: the overlap suite's taps (SGLang's overlap loop, a chunked prompt, zero-split), a
scenario with a tail resume and one with a cancel mid-prefill, host-tier write-through under its
bound and shed under pressure, a conversation restored from the host, an exclusive host's
demotions in flight across passes, speculative decoding under
overlap. All of them: ``test_stream_sanitizer_suites_full.py`` (``make stream-sanitizer``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import test_host_async as host_async
import test_host_exclusive as host_exclusive
import test_host_tier as host_tier
import test_scenarios as scenarios
import test_speculative as speculative
from stream_model_build import under_the_model
from test_host_async import slow_copies  # noqa: F401  # a fixture of the host-async suite
from test_overlap import (  # noqa: F401  # collected here, with this module's build
    test_a_tap_at_the_prompt_end_holds_the_state_it_names,
    test_chunked_prefill_taps_under_overlap,
)


@pytest.fixture
def build(build: Callable[..., Any]) -> Callable[..., Any]:
    return under_the_model(build)


def test_sessions_sharing_a_preamble_that_diverge_inside_a_block(build) -> None:
    scenarios.test_sessions_sharing_a_preamble_that_diverge_inside_a_block(build, page=1)


def test_cancel_mid_prefill_publishes_what_it_computed(build) -> None:
    scenarios.test_cancel_mid_prefill_publishes_what_it_computed(build, page=64)


def test_a_conversation_evicted_from_the_device_resumes_from_host(build) -> None:
    host_tier.test_a_conversation_evicted_from_the_device_resumes_from_host(build, page=1)


def test_write_through_beyond_the_bound_waits_then_is_issued(build, slow_copies) -> None:  # noqa: F811
    host_async.test_write_through_beyond_the_bound_waits_then_is_issued(build, slow_copies)


def test_device_pressure_sheds_the_write_backlog(build, slow_copies) -> None:  # noqa: F811
    host_async.test_device_pressure_sheds_the_write_backlog(build, slow_copies)


def test_demotions_in_flight_across_passes(build, slow_copies) -> None:  # noqa: F811
    host_exclusive.test_demotions_in_flight_across_passes(build, slow_copies)


def test_only_accepted_tokens_reach_the_index_under_overlap(build) -> None:
    speculative.test_only_accepted_tokens_reach_the_index(build, page=1, miss_every=3, overlap=True)


def test_an_endpoint_where_the_last_round_ends_under_overlap(build) -> None:
    speculative.test_an_endpoint_where_the_last_round_ends(build, overlap=True)
