"""Every relative link of the README, docs/ and the model cards reaches its file, and its
``#anchor`` a heading there (GitHub's slugs: lower case, punctuation dropped, spaces to hyphens, a
repeated heading numbered): a heading renamed without its links is a broken page for the reader."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def outside_fences(text: str):
    """(line number, line) of the lines outside ``` code blocks."""
    fence = False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            yield number, line


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for _, line in outside_fences(path.read_text()):
        heading = re.match(r"^#{1,6}\s+(.*)", line)
        if heading:
            name = slug(heading.group(1))
            count = seen.get(name, 0)
            seen[name] = count + 1
            found.add(name if count == 0 else f"{name}-{count}")
        found.update(re.findall(r'<a (?:name|id)="([^"]+)"', line))
    return found


def test_relative_links_reach_their_files_and_headings():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "models").glob("*/README.md"))]
    broken, known = [], {}
    for page in pages:
        for number, line in outside_fences(page.read_text()):
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"[a-z]+:", target):  # (https:, mailto:)
                    continue
                file, _, anchor = target.partition("#")
                destination = (page.parent / file) if file else page
                where = f"{page.relative_to(ROOT)}:{number}: {target}"
                if not destination.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and destination.suffix == ".md":
                    if destination not in known:
                        known[destination] = anchors(destination)
                    if anchor not in known[destination]:
                        broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)
    assert len(pages) > 10


def test_slugs_follow_githubs():
    assert slug("An AMX Xeon, stop 72: the figures (issues 46, 47) — `a.json`") == "an-amx-xeon-stop-72-the-figures-issues-46-47--ajson"
    assert slug("Vision-aware EAGLE heads (`--vision-tokens K`, ViSpec-style)") == "vision-aware-eagle-heads---vision-tokens-k-vispec-style"
