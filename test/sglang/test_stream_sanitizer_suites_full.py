"""All of the overlap, scenario, host-tier and speculative suites again, under the CPU stream model
(``cpu/stream_model``, issue #35): every scheduler these tests build runs with SGLang's
schedule, forward and copy streams emulated, the WAR barrier on and the cache in its CUDA
branches (with SGLang's overlap loop where the test asks for it, as the overlap suite and the
speculative tests' overlap cases do); every cache entry point SGLang calls per pass is a budget
where a host sync fails. A race, a free without ``record_stream`` or a host
sync fails the test where it happens (``StreamViolation``).

The tests are the suites' own (imported, so pytest collects them here with this module's
``build``); each still checks its outputs against the uncached run as it does there. About ten
times their plain time on the CPU (every aten op is followed): ``make stream-sanitizer`` runs
this module (marked ``stream_model_full``, which ``make test`` leaves out); CI runs a subset
from each suite (``test_stream_sanitizer_suites.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from stream_model_build import under_the_model
from test_host_async import *  # noqa: F403
from test_host_tier import *  # noqa: F403
from test_overlap import *  # noqa: F403
from test_scenarios import *  # noqa: F403
from test_speculative import *  # noqa: F403

pytestmark = pytest.mark.stream_model_full


@pytest.fixture
def build(build: Callable[..., Any]) -> Callable[..., Any]:
    return under_the_model(build)
