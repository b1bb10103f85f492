"""Hypothesis profiles of the property suite.

`ci` (the default): a fixed number of examples per test, derandomized, so a
run draws the same examples on every machine and backend; shrinking stays on,
so a failure reports the smallest case. `dev` (`HYPOTHESIS_PROFILE=dev`):
more examples, drawn afresh each run, for local searching.
"""

import os

from hypothesis import HealthCheck
from hypothesis import settings

_COMMON = dict(
    deadline=None,  # a first call compiles; timings are not what is tested
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("ci", max_examples=12, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=200, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
