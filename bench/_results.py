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


def cpu_name() -> str:
    """The CPU a benchmark ran on, as results files name it: lscpu's model name and whether torch
    has 16-bit matrix kernels on it (without them bf16 products run ~100x slower)."""
    import subprocess

    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")
    except (OSError, subprocess.SubprocessError):
        model = "?"
    try:
        import torch

        bf16 = "bf16 kernels" if torch.ops.mkldnn._is_mkldnn_bf16_supported() else "no bf16 kernels"
    except Exception as e:  # an environment without torch, or a torch without the op
        bf16 = f"bf16 kernels unknown ({type(e).__name__})"
    return f"{model}, {bf16} (torch.ops.mkldnn._is_mkldnn_bf16_supported())"


def write_results(out, data: dict, text: str) -> None:
    """`out`.json <- `data`; `out`.md <- `text` (its notes kept, `write_markdown`); `text` printed."""
    import json

    Path(f"{out}.json").write_text(json.dumps(data, indent=1))
    write_markdown(Path(f"{out}.md"), text)
    print(text)
