"""The training panel of notebook 04: Start and Stop, a live figure, progress and validation grids.

Training runs in this process (no subprocess output to parse): Start calls `kit.train.loop.train` in a
background thread so the notebook stays responsive, and the panel follows the training events.
Stop asks the loop to save a checkpoint and end, as Ctrl-C would.
"""

from __future__ import annotations

import html
import io
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit.config import Config
from kit.io import write_with
from kit.report.plots import draw_metrics
from kit.run.folder import RunDir
from kit.train.loop import StopTraining, TrainResult, train

LIVE_FIGURE = "training.png"
"""The live figure's file in the run folder, written when training ends."""


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes:02d}:{secs:02d}"


def figure_png(rows: list[dict[str, Any]], dpi: int = 80) -> bytes:
    """The metrics figure as PNG bytes, drawn without pyplot (safe outside the main thread)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.2))
    FigureCanvasAgg(fig)
    draw_metrics(fig, rows)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    return buf.getvalue()


def _grid_png(path: Path, size: int = 768) -> tuple[bytes, int]:
    """A validation grid shrunk to fit `size`, as PNG bytes, and its width in pixels."""
    from PIL import Image

    with Image.open(path) as im:
        im = im.convert("RGB")
        im.thumbnail((size, size))
        buf = io.BytesIO()
        im.save(buf, format="PNG")
    return buf.getvalue(), im.width


class TrainPanel:
    """Start / Stop buttons, progress, a live loss figure and the latest validation grid."""

    def __init__(
        self,
        config: Config | Callable[[], Config],
        resume: str | None = "latest",
        overwrite: bool = False,
        plot_every: int = 10,
    ) -> None:
        import ipywidgets as W

        # A callable is read when Start is pressed, so edits made in a form above still count.
        self._config = config
        self.resume = resume or None
        self.overwrite = overwrite
        self.plot_every = max(1, plot_every)
        self.thread: threading.Thread | None = None
        self.result: TrainResult | None = None
        self.error: BaseException | None = None
        self.rows: list[dict[str, Any]] = []
        self.run_dir: RunDir | None = None
        self._stop = threading.Event()
        self._started_once = False
        self._clock: tuple[float, int] = (time.perf_counter(), 0)

        self.start_button = W.Button(description="Start", button_style="success", icon="play")
        self.stop_button = W.Button(
            description="Stop", button_style="danger", icon="stop", disabled=True
        )
        self.start_button.on_click(lambda _: self.start())
        self.stop_button.on_click(lambda _: self.stop())
        self.progress = W.IntProgress(value=0, min=0, max=1, description="steps")
        self.status = W.HTML("press Start to train")
        # Both images stay hidden until they hold a picture (a front end draws an empty one as
        # a broken-image icon); the grid is shown at its own width, never stretched.
        self.live = W.Image(format="png", layout=W.Layout(width="100%", display="none"))
        self.live.add_class("kit-live-plot")
        self.grid = W.Image(format="png", layout=W.Layout(display="none"))
        self.grid_label = W.HTML()
        self.widget = W.VBox(
            [
                W.HBox([self.start_button, self.stop_button, self.progress, self.status]),
                self.live,
                self.grid_label,
                self.grid,
            ]
        )
        self.widget.add_class("kit-train-panel")

    @property
    def config(self) -> Config:
        """The config that the next Start trains."""
        return self._config() if callable(self._config) else self._config

    @property
    def running(self) -> bool:
        """Whether training is running in the background now."""
        return self.thread is not None and self.thread.is_alive()

    def start(self) -> threading.Thread | None:
        """Train in a background thread; None when training is already running."""
        if self.running:
            return None
        self.thread = threading.Thread(target=self._background, name="kit-train", daemon=True)
        self.thread.start()
        return self.thread

    def run(self) -> TrainResult:
        """Train in the foreground (headless notebooks, scripts) and return the result."""
        self._stop.clear()
        self.result, self.error = None, None
        self.start_button.disabled, self.stop_button.disabled = True, False
        try:
            resume, overwrite = self.resume, self.overwrite
            if self._started_once:
                # Start after a Stop continues the same run instead of replacing it.
                resume, overwrite = "latest", False
            self._started_once = True
            cfg = self.config
            self.run_dir = RunDir(Path(cfg.train.output_dir))
            self.result = train(cfg, resume=resume, overwrite=overwrite, callbacks=[self.on_event])
            return self.result
        finally:
            self.start_button.disabled, self.stop_button.disabled = False, True

    def stop(self) -> None:
        """Ask training to save a checkpoint and end after the current step."""
        if self.running:
            self._stop.set()
            self.stop_button.disabled = True
            self.status.value = "stopping after this step…"

    def wait(self, timeout: float | None = None) -> TrainResult | None:
        """Wait for background training; its result (None if still running), or its error."""
        if self.thread is not None:
            self.thread.join(timeout)
        if self.error is not None:
            raise self.error
        return self.result

    def on_event(self, event: dict[str, Any]) -> None:
        """Training callback: follow the run and honour a pending Stop."""
        kind = event["kind"]
        if kind == "start":
            # A resumed run's earlier steps come from its log; train has cut it at the resume.
            self.rows = self.run_dir.read_metrics() if self.run_dir else []
            self.progress.max = event["max_steps"]
            self.progress.value = event["step"]
            self._clock = (time.perf_counter(), event["step"])
            self.status.value = f"step {event['step']}/{event['max_steps']} · starting"
        elif kind == "step":
            self.rows.append({k: v for k, v in event.items() if k != "kind"})
            self._progress(event["step"])
            if event["step"] % self.plot_every == 0:
                self.redraw()
            if self._stop.is_set():
                raise StopTraining
        elif kind == "validation":
            self.grid.value, width = _grid_png(Path(event["grid"]))
            self.grid.layout.width = f"{width}px"
            self.grid.layout.display = ""
            self.grid_label.value = f"<b>validation at step {event['step']}</b>"
        elif kind == "end":
            self.redraw()
            if self.rows and self.run_dir is not None:
                write_with(
                    self.run_dir.root / LIVE_FIGURE,
                    lambda tmp: tmp.write_bytes(bytes(self.live.value)),
                )
            result = event["result"]
            word = "stopped" if result.interrupted else "finished"
            self.status.value = html.escape(
                f"{word} at step {result.step}/{self.progress.max}; run the cells below"
            )

    def redraw(self) -> None:
        """Redraw the live figure from the steps seen so far."""
        if self.rows:
            self.live.value = figure_png(self.rows)
            self.live.layout.display = ""

    def _progress(self, step: int) -> None:
        self.progress.value = step
        t0, s0 = self._clock
        elapsed = time.perf_counter() - t0
        rate = (step - s0) / elapsed if elapsed > 0 else 0.0
        left = self.progress.max - step
        eta = _clock(left / rate) if rate > 0 else "--:--"
        self.status.value = f"step {step}/{self.progress.max} · {rate:.2f} steps/s · ETA {eta}"

    def _background(self) -> None:
        try:
            self.run()
        except BaseException as e:  # shown in the panel; `wait` raises it again
            self.error = e
            self.status.value = f"<span style='color:#c00'>{html.escape(str(e))}</span>"

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        # The widget where a front end draws it; elsewhere the status line as text.
        bundle = dict(self.widget._repr_mimebundle_(**kwargs) or {})
        bundle["text/plain"] = html.unescape(re.sub(r"<[^>]+>", "", self.status.value))
        return bundle
