"""The one style of every curve figure the project writes (a run's plots, a sweep's, a study's):
title, axis labels, integer ticks on the step axis, a light grid, a small legend; saved as PNG.
Matplotlib's file-only backend is chosen here, before pyplot is imported anywhere in the package."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only; no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

DPI = 110


def new(width: float = 6.4, height: float = 4.0):
    """A figure and its one axes."""
    return plt.subplots(figsize=(width, height))


def save(fig, ax, path: Path, *, title: str, xlabel: str, ylabel: str) -> Path:
    """Style `ax`, write `fig` to `path` (parents created) and close it."""
    ax.set_title(title)
    ax.set_xlabel(xlabel)
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
