"""The suite's two tiers. ``make test`` (CI) runs every test except those marked ``slow``: the exhaustive sweeps
(every Hugging Face family, every strategy of a random search, the large-model runs), each of which has a
cheaper case in the default tier that checks the same property. ``make test-full`` (or
``HYDRAULIS_FULL_TESTS=1``) runs them all; run it before a release and after touching the runtime."""

from __future__ import annotations

import pytest
from tiers import FULL


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: an exhaustive sweep, run by `make test-full` (HYDRAULIS_FULL_TESTS=1)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if FULL:
        return
    skip = pytest.mark.skip(reason="slow sweep: run with `make test-full` (HYDRAULIS_FULL_TESTS=1)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
