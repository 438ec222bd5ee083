"""Plotting shared by the studies' reports. matplotlib is imported when a plot is drawn, so a
study that never plots (or a machine without a display) does not pay for it."""

from __future__ import annotations

from typing import Any


def pyplot() -> Any:
    """`matplotlib.pyplot` on the file-only Agg backend (the studies write PNGs, never show)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
