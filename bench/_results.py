"""Writing a bench/results/*.md file without losing its hand-written notes.

Each benchmark regenerates its results file from scratch. Everything from the heading
`## Notes and history` on is kept: it is the narrative of earlier runs (what changed between
them, what was measured by hand), which no rerun can reproduce.
"""

from pathlib import Path

NOTES = "## Notes and history"


def write_markdown(path: Path, text: str) -> None:
    """Write `text` to `path`, followed by the notes section `path` already holds, if any."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    at = old.find("\n" + NOTES)
    notes = old[at + 1:] if at >= 0 else (old if old.startswith(NOTES) else "")
    path.write_text(text.rstrip("\n") + "\n\n" + notes if notes else text, encoding="utf-8")
