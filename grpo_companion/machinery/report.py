"""What a chapter hands to the book: figures as files, headline numbers as JSON and glue.

Every chapter notebook makes one `ChapterReport` from its papermill parameters, saves each
figure through it (PNG for the page, SVG for slides and papers) and records each headline
number through it.  A recorded number is glued for the prose (myst-nb `{glue:text}`) and written
to `results.json`, so the text, the figures and chapter 12's ledger read the same value.
"""

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import seaborn as sns

# One style for every figure of the book.
STYLE = {"context": "notebook", "style": "whitegrid", "palette": "colorblind"}
RC = {
    "figure.figsize": (6.4, 4.0),
    "figure.dpi": 110,
    "savefig.dpi": 150,
    "savefig.bbox": "tight",
    "svg.hashsalt": "grpo",
}


def set_style() -> None:
    sns.set_theme(**STYLE, rc=RC)


def _plain(value):
    """Numbers as JSON can hold them: tensors and numpy scalars become Python floats and ints."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"refusing to record a non-finite number: {value}")
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


class ChapterReport:
    """Collects one chapter's figures and results under `output_dir`.

    `output_dir/figures/<name>.{png,svg}` and `output_dir/results.json`; the pipeline publishes
    them as `_build/figures/<chapter>/` and `_build/results/<chapter>.json` once the whole
    chapter has run.
    """

    def __init__(self, chapter: str, output_dir: str, profile: str, seed: int):
        self.chapter = chapter
        self.output_dir = Path(output_dir)
        self.results = {
            "chapter": chapter,
            "profile": profile,
            "seed": seed,
            "values": {},
            "figures": [],
        }
        (self.output_dir / "figures").mkdir(parents=True, exist_ok=True)
        set_style()

    def figure(self, fig: plt.Figure, name: str) -> plt.Figure:
        """Save `fig` as PNG and SVG; returns it so the notebook displays it inline too."""
        for suffix in ("png", "svg"):
            # SVGs embed a date and random ids unless told otherwise: fixed ones keep reruns
            # identical.
            metadata = {"Date": None} if suffix == "svg" else None
            fig.savefig(self.output_dir / "figures" / f"{name}.{suffix}", metadata=metadata)
        self.results["figures"].append(name)
        return fig

    def record(self, name: str, value, display: bool = False):
        """Glue `value` for the prose and keep it for results.json; returns it.

        The plain Python number is glued: myst-nb cannot format a numpy or torch scalar with a
        format spec like `:.3f`, and the text should show exactly what results.json holds.
        """
        from myst_nb import glue

        self.results["values"][name] = _plain(value)
        glue(name, self.results["values"][name], display=display)
        return value

    def record_all(self, values: dict, prefix: str = "") -> dict:
        """`record` each of `values` under `prefix + key`, the one line a section needs to
        publish its numbers; returns `values`."""
        for key, value in values.items():
            self.record(prefix + key, value)
        return values

    def write(self) -> Path:
        """Write results.json, with the kernel's part of the provenance record (package
        versions, torch threads, CPU, GPU, CPU seconds so far); the pipeline adds its own."""
        from grpo_companion.machinery.provenance import kernel_provenance

        self.results["provenance"] = kernel_provenance()
        path = self.output_dir / "results.json"
        path.write_text(json.dumps(self.results, indent=2, sort_keys=True) + "\n")
        return path
