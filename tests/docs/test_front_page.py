"""README.md is a front page: small, the two working commands first, its links into docs/ resolve;
the dated results in docs/results/ each name their machine and no machine-local path."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
LINK_RE = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")
# Paths that exist only on the machine that measured (home directories, checkouts, scratch).
MACHINE_PATH_RE = re.compile(r"(?<![\w.~])/(?:work|home|root|tmp|mnt|scratch)/")


def test_the_readme_is_at_most_10_kb():
    size = len(README.read_bytes())
    assert size <= 10_000, f"README.md is {size} bytes: move the detail into a docs/ page"


def test_the_readme_opens_with_the_two_commands():
    first_block = re.search(r"^```bash\n(.*?)^```", README.read_text(), re.MULTILINE | re.DOTALL)
    assert first_block
    commands = [line.split("#")[0].strip() for line in first_block.group(1).splitlines() if line.strip()]
    assert commands == ["pip install -e . && himamba serve", "scripts/test.sh"]


def test_every_link_of_the_readme_resolves():
    targets = [m.group(1) for m in LINK_RE.finditer(README.read_text()) if "://" not in m.group(1)]
    assert any(t.startswith("docs/results/") for t in targets), "no headline links to docs/results"
    for target in targets:
        assert (ROOT / target).exists(), f"README.md links to {target}, which does not exist"


def test_every_results_page_names_its_machine_and_no_machine_path():
    pages = sorted((ROOT / "docs" / "results").rglob("*.md"))
    assert len(pages) > 3
    for page in pages:
        text = page.read_text()
        rel = page.relative_to(ROOT)
        assert not MACHINE_PATH_RE.search(text), f"{rel} names a machine-local path: {MACHINE_PATH_RE.search(text)}"
        if page.name != "index.md":
            assert re.search(r"\*\*Machine\*\*|^Device:", text, re.MULTILINE), f"{rel} does not name its machine"
