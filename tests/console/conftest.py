"""The browser the console's end-to-end tests drive: Debian's chromium through Playwright.

Without chromium on this machine the browser tests are skipped, saying why; where the
browser is required (``WAYBILL_TEST_BROWSER=required``, which ``.ci/run`` sets, or ``CI``
set as CI services do) its absence fails them instead, so CI never passes them silently.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("WAYBILL_TEST_CHROMIUM", "/usr/bin/chromium")


def _required() -> bool:
    return os.environ.get("WAYBILL_TEST_BROWSER") == "required" or os.environ.get(
        "CI", ""
    ).lower() in ("1", "true", "yes")


def _missing() -> str | None:
    if not (Path(CHROMIUM).is_file() or shutil.which(CHROMIUM)):
        return f"no chromium at {CHROMIUM} (apt-get install chromium)"
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "the playwright package is not installed (pip install -e '.[dev]')"
    return None


@pytest.fixture
async def chromium() -> AsyncIterator[object]:
    """A headless Chromium browser (Playwright's ``Browser``)."""
    missing = _missing()
    if missing is not None:
        if _required():
            pytest.fail(f"the console's browser tests must run here, but {missing}")
        pytest.skip(f"browser tests skipped: {missing}")
    from playwright.async_api import async_playwright

    async with async_playwright() as playwright:
        # As root (CI) Chromium's sandbox cannot start; the pages are our own.
        browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            yield browser
        finally:
            await browser.close()
