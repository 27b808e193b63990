"""The documentation's own links: every relative link in README.md and docs/*.md names a
file of the repository and, into a Markdown file, a heading that file has; and the README
keeps the two commands that `.ci/run` and a newcomer start from."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# a link's target: [text](target) or [text](target "title"); images too
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`]*`")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines outside fenced code blocks, with their numbers."""
    lines: list[tuple[int, str]] = []
    fenced = False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped (hyphens and
    underscores kept), each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _prose_lines(path):
        match = _HEADING.match(line)
        if match is None:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[tuple[int, str]]:
    found: list[tuple[int, str]] = []
    for number, line in _prose_lines(path):
        for target in _LINK.findall(_CODE_SPAN.sub("", line)):
            found.append((number, target))
    return found


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    problems: list[str] = []
    for number, target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...: not ours
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif not dest.is_relative_to(root):
            problems.append(f"{where}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with that anchor")
    return problems


def test_every_relative_link_resolves() -> None:
    problems = [problem for path in documents() for problem in broken_links(path)]
    assert problems == []


def test_the_checker_finds_a_missing_file_and_a_missing_anchor(tmp_path: Path) -> None:
    # a checker that never complains would pass the test above: it must see both kinds
    assert links(ROOT / "docs" / "README.md"), "the index has links"
    (tmp_path / "jobs.md").write_text("# Jobs\n")
    page = tmp_path / "probe.md"
    page.write_text(
        "# Probe\n\n## A heading (`with code`), and 2,000 runs/s\n\n"
        "[ok](#a-heading-with-code-and-2000-runss) [file](jobs.md) [web](https://x.invalid/)\n"
        "[gone](no-such-file.md) [bad](jobs.md#no-such-heading) `[code](span.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
    )
    problems = broken_links(page, tmp_path)
    assert [p.split(": ", 1)[1] for p in problems] == [
        "no-such-file.md: no such file",
        "jobs.md#no-such-heading: no heading with that anchor",
    ]


def test_slug_matches_github_for_the_headings_we_use() -> None:
    assert slug("Dependencies (`--after`)") == "dependencies---after"
    assert slug("High availability: Postgres with a standby (Patroni)") == (
        "high-availability-postgres-with-a-standby-patroni"
    )
    assert slug("Every-host jobs and @reboot") == "every-host-jobs-and-reboot"


def test_the_readme_keeps_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    for command in ("make demo   # ", "make test   # "):
        assert f"\n{command}" in readme, command
    assert (ROOT / ".ci" / "run").read_text().rstrip().endswith("exec make test")
