"""The whole suite's settings: hypothesis draws the same examples on every run (the `ci` profile,
derandomized), so no result depends on a random draw. `pytest --hypothesis-profile=explore`
draws new ones; a failure found that way is kept with `@example` once fixed."""

from __future__ import annotations

import importlib.util

# The GPU check (scripts/gpu/check.sh) runs tests/gpu in an image without the test extra.
if importlib.util.find_spec("hypothesis") is not None:
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, database=None)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile("ci")
