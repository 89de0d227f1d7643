"""Which tier of the suite runs: ``FULL`` when ``HYDRAULIS_FULL_TESTS`` is set (``make test-full``), else the
default tier of ``make test`` (CI). Tests that draw random cases draw fewer of them in the default tier."""

from __future__ import annotations

import os

FULL = os.environ.get("HYDRAULIS_FULL_TESTS", "") not in ("", "0")
