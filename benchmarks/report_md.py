"""Benchmark sections in a Markdown file (BENCHMARKS.md): each benchmark script writes one
`## ...` section, and a rerun replaces that section in place rather than appending a copy.

Only the benchmark scripts write these files, so this lives beside them and not in the
package: `batchserve bench` writes its own report (`batchserve.bench.report`).
"""
from __future__ import annotations

import os

def publish(text: str, out: str | None, heading: str) -> int:
    """Print a benchmark's markdown section and, with `out`, replace it in that file; exit code 0."""
    print(text)
    if out:
        write_section(out, heading, text)
    return 0


# Ends the generated part of a section in BENCHMARKS.md: a rerun replaces the section's text up
# to this line and keeps what follows (the readings written by hand about earlier runs).
KEEP_MARK = "<!-- generated above; what follows in this section is kept when the benchmark reruns -->"


def write_section(path: str, heading: str, report: str) -> None:
    """Put `report` (a section starting with `heading`) into a markdown file: replace the
    generated part of the section starting with `heading`, keeping whatever follows its
    KEEP_MARK line; a section without the mark is replaced whole; a missing one is appended."""
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n\n"
    report = report.rstrip("\n") + "\n\n" + KEEP_MARK
    # at the start of a line only: "## X" must not match inside a "### X ..." heading
    line = text.find("\n" + heading)
    start = 0 if text.startswith(heading) else line + 1 if line >= 0 else -1
    if start < 0:
        text = text.rstrip() + "\n\n" + report + "\n"
    else:
        nxt = text.find("\n## ", start + 1)
        end = nxt + 1 if nxt >= 0 else len(text)
        mark = text.find(KEEP_MARK, start, end)
        kept = text[mark + len(KEEP_MARK):end] if mark >= 0 else "\n\n" if nxt >= 0 else "\n"
        text = text[:start] + report + kept + text[end:]
    with open(path, "w") as fh:
        fh.write(text)

