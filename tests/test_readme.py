"""The README stays a newcomer's page: 12 KB at most (it once grew to 15.3 KB), and every docs link in it leads
to a file that exists."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_is_short_and_its_links_resolve():
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode())} bytes: move detail into docs/"
    targets = set(re.findall(r"\]\((docs/[^)#]+)", text))
    assert targets and all((ROOT / target).exists() for target in targets), targets
