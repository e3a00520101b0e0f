"""Figures of a run: loss (raw and smoothed), learning rate, gradient norm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kit.io import write_with


def smooth(values: list[float], beta: float = 0.9) -> list[float]:
    """Bias-corrected exponential moving average (as TensorBoard draws it)."""
    out, avg = [], 0.0
    for i, v in enumerate(values, 1):
        avg = beta * avg + (1 - beta) * v
        out.append(avg / (1 - beta**i))
    return out


def metrics_figure(rows: list[dict[str, Any]]):
    """A matplotlib figure of loss, learning rate and gradient norm against step."""
    import matplotlib

    if matplotlib.get_backend().lower() not in ("module://matplotlib_inline.backend_inline",):
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(12, 3.2))
    draw_metrics(fig, rows)
    return fig


def draw_metrics(fig: Any, rows: list[dict[str, Any]]) -> None:
    """Draw loss, learning rate and gradient norm onto `fig` (a pyplot-free Figure works too)."""
    ax_loss, ax_lr, ax_gn = fig.subplots(1, 3)
    steps = [r["step"] for r in rows]
    loss = [r["loss"] for r in rows]
    ax_loss.plot(steps, loss, alpha=0.35, label="loss")
    if loss:
        ax_loss.plot(steps, smooth(loss), label="smoothed")
    for key, style in (("stable_loss", "o-"), ("validation_loss", "s--")):
        marked = [(r["step"], r[key]) for r in rows if key in r]
        if marked:
            ax_loss.plot(
                *zip(*marked, strict=True), style, markersize=3, label=key.replace("_", " ")
            )
    ax_loss.set_title("loss")
    ax_loss.legend(loc="upper right")
    ax_lr.plot(steps, [r["lr"] for r in rows])
    ax_lr.set_title("learning rate")
    gn = [(r["step"], r["grad_norm"]) for r in rows if r.get("grad_norm") is not None]
    ax_gn.plot([s for s, _ in gn], [g for _, g in gn])
    ax_gn.set_title("gradient norm")
    for ax in (ax_loss, ax_lr, ax_gn):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()


def plot_metrics(rows: list[dict[str, Any]], path: str | Path) -> Path | None:
    """Save the metrics figure as a PNG (atomic); None when nothing was logged."""
    if not rows:
        return None
    # A Figure outside pyplot: training may run in a background thread (the notebook panel).
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.2))
    draw_metrics(fig, rows)
    write_with(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    return Path(path)
