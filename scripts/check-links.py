#!/usr/bin/env python3
"""Checks that every relative link of the project's Markdown resolves: the file exists, and an `#anchor` names a
heading of the page it points to (GitHub's slugs). Links inside code are not links; web addresses are not
fetched (nothing outside is reachable from CI's machine).

    python3 scripts/check-links.py            # README.md, CHANGELOG.md, docs/, benches/, examples/, scripts/
    python3 scripts/check-links.py --self-test

Exits 1 naming each broken link as file:line: target (why).
"""

import os
import re
import sys
import tempfile
from pathlib import Path

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SKIP_DIRS = {"target", ".git", "node_modules"}


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than `-` and `_` dropped, spaces to `-`."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = text.lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def prose_lines(text: str):
    """(line number, line) of the lines outside fenced code blocks, inline code blanked."""
    fence = None
    for number, line in enumerate(text.split("\n"), 1):
        stripped = line.lstrip()
        if fence is None and (stripped.startswith("```") or stripped.startswith("~~~")):
            fence = stripped[:3]
            continue
        if fence is not None:
            if stripped.startswith(fence):
                fence = None
            continue
        yield number, re.sub(r"`[^`]*`", lambda m: " " * len(m.group(0)), line)


def page_anchors(page: Path, cache: dict) -> set:
    if page not in cache:
        # Anchors come from the raw headings (with their inline code), outside fences.
        text = page.read_text(encoding="utf-8")
        found, seen, fence = set(), {}, None
        for line in text.split("\n"):
            stripped = line.lstrip()
            if fence is None and stripped.startswith(("```", "~~~")):
                fence = stripped[:3]
                continue
            if fence is not None:
                if stripped.startswith(fence):
                    fence = None
                continue
            match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if match:
                base = slug(match.group(1))
                count = seen.get(base, 0)
                seen[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
        cache[page] = found
    return cache[page]


def check(root: Path, pages) -> list:
    broken, cache = [], {}
    for page in pages:
        for number, line in prose_lines(page.read_text(encoding="utf-8")):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                path, _, anchor = target.partition("#")
                dest = page if not path else (page.parent / path)
                where = f"{page.relative_to(root)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no file {os.path.normpath(dest.relative_to(root) if dest.is_relative_to(root) else dest)})")
                    continue
                if anchor and dest.suffix == ".md" and anchor not in page_anchors(dest.resolve(), cache):
                    broken.append(f"{where} (no heading with anchor #{anchor} in {dest.resolve().relative_to(root.resolve())})")
    return broken


def markdown_pages(root: Path):
    for top in ["README.md", "CHANGELOG.md"]:
        if (root / top).exists():
            yield root / top
    for folder in ["docs", "benches", "examples", "scripts", "crates", "backends", "tests"]:
        for dirpath, dirnames, filenames in os.walk(root / folder):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for name in sorted(filenames):
                if name.endswith(".md"):
                    yield Path(dirpath) / name


def self_test() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "docs").mkdir()
        (root / "docs" / "a.md").write_text(
            "# Title\n\n## Block-wise `FULL_SHARD`: one block\n\n## Same\n\n## Same\n\n```\n## not a heading\n```\n",
            encoding="utf-8",
        )
        good = (
            "[a](docs/a.md) [b](docs/a.md#block-wise-full_shard-one-block) [c](docs/a.md#same-1) "
            "[d](https://example.org/x) ![e](docs/a.md) `[f](nowhere.md)` [g](#top)\n\n# Top\n"
        )
        bad = {
            "[x](docs/missing.md)": "no file",
            "[x](docs/a.md#not-a-heading)": "no heading",
            "[x](docs/a.md#same-2)": "no heading",
            "[x](#nowhere)": "no heading",
        }
        (root / "README.md").write_text(good, encoding="utf-8")
        failures = []
        if check(root, [root / "README.md"]):
            failures.append(f"good links reported broken: {check(root, [root / 'README.md'])}")
        for text, why in bad.items():
            (root / "README.md").write_text(text + "\n", encoding="utf-8")
            found = check(root, [root / "README.md"])
            if len(found) != 1 or why not in found[0]:
                failures.append(f"{text}: expected one '{why}', got {found}")
        (root / "README.md").write_text("```sh\n[x](docs/missing.md)\n```\n", encoding="utf-8")
        if check(root, [root / "README.md"]):
            failures.append("a link inside a code fence was checked")
    for failure in failures:
        print(f"self-test: {failure}", file=sys.stderr)
    print(f"check-links self-test: {len(failures)} failure(s) in 6 checks")
    return 1 if failures else 0


def main() -> int:
    if "--self-test" in sys.argv[1:]:
        return self_test()
    root = Path(__file__).resolve().parent.parent
    pages = list(markdown_pages(root))
    broken = check(root, pages)
    for line in broken:
        print(line, file=sys.stderr)
    print(f"links: {len(broken)} broken in {len(pages)} Markdown files")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
