"""The documentation builds and its links hold: the MkDocs site under docs/ and the README that points into it.

The site is built with `mkdocs build --strict` as a reader would build it; mkdocs.yml's validation settings make
a broken link, a missing anchor or a page left out of the nav a warning, and strict mode a failed build. The
README is read on GitHub, not built, so its relative links are checked here against the files themselves.
"""
from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$", re.M)


def build_site(config: pathlib.Path, site: pathlib.Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=120)


def link_targets(markdown: str) -> list[str]:
    """Targets of inline links, outside fenced code blocks and code spans (where brackets are code)."""
    return INLINE_LINK.findall(CODE_SPAN.sub("", FENCE.sub("", markdown)))


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors_of(markdown_file: pathlib.Path) -> set[str]:
    return {github_anchor(h) for h in HEADING.findall(FENCE.sub("", markdown_file.read_text()))}


def nav_pages(nav: list) -> set[str]:
    pages: set[str] = set()
    for entry in nav:
        for value in (entry.values() if isinstance(entry, dict) else [entry]):
            pages |= nav_pages(value) if isinstance(value, list) else {value}
    return pages


def test_the_site_builds_strict_without_a_warning(tmp_path):
    result = build_site(ROOT / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "WARNING" not in output, output
    for page in nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]):
        built = "index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html"
        assert (tmp_path / "site" / built).is_file(), f"{page} was not built"


@pytest.mark.parametrize("broken", ["[gone](no-such-page.md)", "[no heading](architecture.md#no-such-heading)",
                                    "[outside the site](../README.md)"])
def test_a_broken_link_or_anchor_fails_the_build(tmp_path, broken):
    """The validation settings are on: without them MkDocs logs a missing anchor at INFO and builds anyway."""
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with (tmp_path / "docs" / "index.md").open("a") as page:
        page.write(f"\n{broken}\n")
    result = build_site(tmp_path / "mkdocs.yml", tmp_path / "site")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    target = broken[broken.index("(") + 1:-1]
    assert any("WARNING" in line and target in line for line in output.splitlines()), output


def test_every_page_under_docs_is_in_the_nav():
    nav = nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    pages = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")} - {"README.md"}
    assert pages == nav, f"in docs/ but not in the nav: {sorted(pages - nav)}; in the nav only: {sorted(nav - pages)}"


def test_every_relative_link_in_the_readme_points_at_a_file():
    targets = [t for t in link_targets(README.read_text()) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]
    assert "docs/index.md" in targets  # the parser found the links (a broken pattern would find none)
    for target in targets:
        path, _, anchor = target.partition("#")
        file = (ROOT / path) if path else README
        assert file.exists(), f"README.md links to {target}: {file.relative_to(ROOT)} does not exist"
        if anchor and file.suffix == ".md":
            assert anchor in anchors_of(file), f"README.md links to {target}: no such heading in {path or 'README.md'}"


def test_link_targets_skip_code():
    text = ('[a](docs/a.md) `[b](not/a/link.md)`\n```python\nreply = x[0](1)\nmsgs=[{"r": 1}](y)\n```\n'
            '[c](https://example.com) [d](#here)\n')
    assert link_targets(text) == ["docs/a.md", "https://example.com", "#here"]


def test_github_anchor():
    assert github_anchor("The local closed loop (`make run`)") == "the-local-closed-loop-make-run"
    assert github_anchor("Which CPUs: one engine for every x86 tier") == "which-cpus-one-engine-for-every-x86-tier"


def test_the_readme_stays_a_page_for_users():
    """Measured figures and logs go to docs/; the README keeps what a newcomer needs."""
    assert len(README.read_text().splitlines()) < 200
