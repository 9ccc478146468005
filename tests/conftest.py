"""Test-wide settings: hypothesis profiles.

`pytest` runs the CI-sized property tests. `pytest --hypothesis-profile=long`
runs every property test with 20 times as many examples (a long fuzz run).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("default", settings.get_profile("default"))
settings.register_profile("long", deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

LONG_FACTOR = 20


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if settings.get_current_profile_name() != "long":
        return
    for item in items:
        fn = getattr(item, "obj", None)
        own = getattr(fn, "_hypothesis_internal_use_settings", None)
        if own is not None:
            fn._hypothesis_internal_use_settings = settings(  # type: ignore[union-attr]
                own, max_examples=own.max_examples * LONG_FACTOR, deadline=None)
