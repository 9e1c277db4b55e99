"""Relative links in the repository's Markdown point at files that exist, and the README links
every page under docs/.

A link is ``[text](target)`` (an image's ``![alt](target)`` too) or a reference definition
``[label]: target``. Links to ``http:``, ``https:`` and ``mailto:`` and pure ``#anchor`` links are
not checked; for ``path#anchor`` only the path is. Fenced code blocks and inline code are skipped,
because brackets there are code, not links. Anchors are not checked: GitHub derives them from
headings, and a renamed heading is cheaper to spot by eye than to slugify here.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]

INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?([^\s>]+)>?")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
FENCE = re.compile(r"^\s{0,3}(`{3,}|~{3,})")
EXTERNAL = ("http:", "https:", "mailto:")


def markdown_files() -> list[Path]:
    """Every tracked *.md, plus README.md and docs/*.md even before they are committed."""
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    files = {ROOT / name for name in listed.stdout.splitlines() if name}
    files |= {ROOT / "README.md", *(ROOT / "docs").glob("*.md")}
    return sorted(f for f in files if f.is_file())  # a tracked file deleted in the work tree is gone


def links(path: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link in ``path`` outside code."""
    found: list[tuple[int, str]] = []
    fence = ""
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        opening = FENCE.match(line)
        if fence:
            if opening and opening.group(1)[0] == fence[0] and len(opening.group(1)) >= len(fence):
                fence = ""
            continue
        if opening:
            fence = opening.group(1)
            continue
        text = INLINE_CODE.sub("", line)
        found += [(number, m.group(1)) for m in INLINE_LINK.finditer(text)]
        found += [(number, m.group(1)) for m in REFERENCE_DEF.finditer(text)]
    return found


def local_target(source: Path, target: str) -> Path | None:
    """The file a relative link points at, or None when the link is not a local path."""
    if not target or target.startswith("#") or target.lower().startswith(EXTERNAL):
        return None
    path = unquote(target.split("#", 1)[0].split("?", 1)[0])
    if path.startswith("/"):  # GitHub reads a leading slash as the repository's root
        return ROOT / path.lstrip("/")
    return source.parent / path


def test_relative_links_resolve() -> None:
    broken = []
    for source in markdown_files():
        for number, target in links(source):
            resolved = local_target(source, target)
            if resolved is not None and not resolved.exists():
                broken.append(f"{source.relative_to(ROOT)}:{number}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_readme_links_every_docs_page() -> None:
    readme = ROOT / "README.md"
    linked = {t.resolve() for _, target in links(readme) if (t := local_target(readme, target)) is not None}
    missing = [p.relative_to(ROOT).as_posix() for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, "docs pages the README does not link: " + ", ".join(missing)


def test_the_checker_sees_links_and_skips_code(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "[a](a.md) and ![img](pics/x.png \"title\") and [b](b.md#part) [web](https://x.org) [top](#top)\n"
        "`[not](code.md)`\n"
        "```\n[not](fenced.md)\n```\n"
        "[ref]: ref.md\n",
        encoding="utf-8",
    )
    assert [t for _, t in links(page)] == ["a.md", "pics/x.png", "b.md#part", "https://x.org", "#top", "ref.md"]
    assert local_target(page, "b.md#part") == tmp_path / "b.md"
    assert local_target(page, "https://x.org") is None and local_target(page, "#top") is None
