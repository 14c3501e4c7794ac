"""`python -m bench --only KEYS --update BENCHMARKS.md`: re-run some sections and put them into an existing file.

A full run takes about half an hour on this machine; a change that moves one section's figures should not need
it, nor leave that section stale. Splicing keeps every other section as its own run wrote it and stamps each
re-run section (and the file's header) with when, by which command, at which commit and under which load it was
measured, so no figure loses its provenance. Pure text: the document is split at its `## ` headings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

HEADLINE = "## Headline"
STAMP = "Re-run since:"


@dataclass(frozen=True, kw_only=True)
class Document:
    """BENCHMARKS.md as parts: the header, the headline bullets and the sections in order."""

    header: list[str]
    """Lines before `## Headline` (title, provenance, machine table)."""
    bullets: list[str]
    """The headline's `- **title**: …` lines (and a FAILED line, if any)."""
    sections: list[tuple[str, list[str]]]
    """(title, body lines) per `## title`, in file order."""


def parse(text: str) -> Document:
    """Split a BENCHMARKS.md written by `render_document`; refuse anything else (one line naming the fix)."""
    lines = text.splitlines()
    if HEADLINE not in lines:
        raise ValueError(f"no '{HEADLINE}' heading: not a file `python -m bench` wrote; run it without --update")
    at = lines.index(HEADLINE)
    header, rest = lines[:at], lines[at + 1:]
    bullets: list[str] = []
    while rest and not rest[0].startswith("## "):
        line = rest.pop(0)
        if line.startswith("- "):
            bullets.append(line)
    sections: list[tuple[str, list[str]]] = []
    for line in rest:
        if line.startswith("## "):
            sections.append((line[3:], []))
        elif sections:
            sections[-1][1].append(line)
    return Document(header=header, bullets=bullets, sections=sections)


def _owner(bullet: str, titles: Sequence[str]) -> str | None:
    return next((t for t in titles if bullet.startswith(f"- **{t}**:")), None)


def splice(old: str, new: str, *, order: Sequence[str], stamp: str) -> str:
    """`old` with every section of `new` (a document of re-run sections) put in its place, in `order` (the suite's
    section titles), its headline bullets replaced, and `stamp` (when/what/commit/load) noted in the header and
    under each re-run section's heading."""
    a, b = parse(old), parse(new)
    fresh = {title: body for title, body in b.sections}
    titles = list(order) + [t for t, _ in a.sections if t not in order]
    bodies = dict(a.sections) | {t: ["", f"<sub>{STAMP} {stamp}</sub>", *body] for t, body in fresh.items()}
    bullets = [x for x in a.bullets if _owner(x, fresh) is None and not x.startswith("- **FAILED sections**")]
    bullets += [x for x in b.bullets if _owner(x, list(fresh)) is not None]
    bullets.sort(key=lambda x: titles.index(_owner(x, titles)) if _owner(x, titles) else len(titles))
    failed = [x for x in b.bullets if x.startswith("- **FAILED sections**")]
    header = [h for h in a.header]
    note = f"{STAMP} {', '.join(f'*{t}*' for t in fresh)} — {stamp}."
    while header and not header[-1].strip():
        header.pop()
    header += ["", note, ""]
    lines = [*header, HEADLINE, "", *bullets, *failed, ""]
    for title in titles:
        if title in bodies:
            body = list(bodies[title])
            while body and not body[-1].strip():
                body.pop()
            lines += [f"## {title}", *body, ""]
    return "\n".join(lines).rstrip() + "\n"
