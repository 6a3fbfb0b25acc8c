"""The one style of every curve figure the project writes (a run's plots, a sweep's, a study's):
curves with a small dot at each logged step, title, axis labels, integer ticks on the step axis, a
light grid, a small legend; saved as PNG. Callers say what to draw, never how it looks, so that
every figure reads the same way.
Matplotlib's file-only backend is chosen here, before pyplot is imported anywhere in the package."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402
from numpy.typing import ArrayLike  # noqa: E402

DPI = 110


def new(width: float = 6.4, height: float = 4.0):
    """A figure and its one axes."""
    return plt.subplots(figsize=(width, height))


def curve(ax: Axes, steps: ArrayLike, values: ArrayLike, label: str) -> Line2D:
    """One curve, a dot at each step (a sparse or gappy metric stays readable); returns the line,
    whose colour a band around it takes."""
    line, = ax.plot(steps, values, marker="o", markersize=3, label=label)
    return line


def save(fig, ax, path: Path, *, title: str, xlabel: str, ylabel: str, integer_x: bool = True) -> Path:
    """Style `ax`, write `fig` to `path` (parents created) and close it. `integer_x`: integer
    ticks on the x axis (steps); False for a categorical axis that set its own ticks."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def close(fig) -> None:
    """Close a figure that is not written (nothing to draw, or an error)."""
    plt.close(fig)
