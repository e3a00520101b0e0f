"""The training panel on the tiny model: background training, Stop with a checkpoint, exact resume."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from kit.config import load_config
from kit.run import checkpoint as ckpt
from kit.train.loop import StopTraining, train
from kit.ui.panel import LIVE_FIGURE, TrainPanel

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_start_trains_in_the_background_and_shows_progress(make_config):
    cfg = load_config(make_config(max_train_steps=4, validation_steps=2))
    panel = TrainPanel(cfg, plot_every=2)
    assert [panel.start_button.description, panel.stop_button.description] == ["Start", "Stop"]
    assert "kit-train-panel" in panel.widget._dom_classes
    assert "kit-live-plot" in panel.live._dom_classes
    panel.start_button.click()
    assert panel.thread is not None
    result = panel.wait(timeout=300)
    assert not panel.thread.is_alive()
    assert result is panel.result and result.step == 4 and not result.interrupted
    assert panel.progress.description == "steps"
    assert panel.progress.value == panel.progress.max == 4
    assert bytes(panel.live.value).startswith(PNG)
    assert bytes(panel.grid.value).startswith(PNG)  # the validation grid of step 4
    assert "step 4" in panel.grid_label.value
    assert (result.run_dir / LIVE_FIGURE).read_bytes() == bytes(panel.live.value)
    assert "finished at step 4/4" in panel.status.value


def test_status_reads_step_rate_and_eta(make_config):
    panel = TrainPanel(load_config(make_config()))
    panel.progress.max = 10
    panel._clock = (panel._clock[0] - 2.0, 0)  # two seconds ago, at step 0
    panel._progress(4)
    text = panel.status.value
    assert text.startswith("step 4/10 · ") and " steps/s · ETA 00:0" in text
    rate = float(text.split(" · ")[1].split()[0])
    assert 1.5 < rate < 2.1  # four steps in a little over two seconds


@pytest.mark.slow
def test_stop_checkpoints_and_start_resumes_exactly(tmp_path, make_config):
    steps = 8
    common = {"max_train_steps": steps, "checkpointing_steps": 100, "lora_dropout": 0.1}
    train(load_config(make_config("ref.json", output_dir=str(tmp_path / "ref"), **common)))
    reference = load_file(str(ckpt.checkpoint_dir(tmp_path / "ref", steps) / ckpt.ADAPTER_FILE))

    panel = TrainPanel(load_config(make_config(**common)), plot_every=1)
    follow = panel.on_event

    def press_stop_at_step_3(event):
        if event["kind"] == "step" and event["step"] == 3:
            panel.stop_button.click()
        follow(event)

    panel.on_event = press_stop_at_step_3
    panel.start_button.click()
    stopped = panel.wait(timeout=300)
    assert stopped.interrupted and stopped.step == 3
    assert [c.name for c in ckpt.list_checkpoints(stopped.run_dir)] == ["step-000003"]
    assert "stopped at step 3/8" in panel.status.value
    assert not panel.start_button.disabled and panel.stop_button.disabled

    panel.on_event = follow
    panel.start_button.click()  # a second Start continues the run from its checkpoint
    done = panel.wait(timeout=300)
    assert done.step == steps and not done.interrupted
    assert [r["step"] for r in panel.rows] == list(range(1, steps + 1))
    again = load_file(str(ckpt.checkpoint_dir(done.run_dir, steps) / ckpt.ADAPTER_FILE))
    assert reference.keys() == again.keys()
    assert all(torch.equal(reference[k], again[k]) for k in reference)


def test_a_callback_may_stop_training(make_config):
    def stop_at_2(event):
        if event["kind"] == "step" and event["step"] == 2:
            raise StopTraining

    result = train(load_config(make_config(max_train_steps=6)), callbacks=[stop_at_2])
    assert result.interrupted and result.step == 2
    assert result.checkpoint is not None and result.checkpoint.name == "step-000002"


def test_errors_in_the_background_reach_wait_and_the_status(make_config):
    panel = TrainPanel(load_config(make_config(pretrained_model="/nowhere/model")))
    panel.start()
    with pytest.raises(Exception, match="nowhere"):
        panel.wait(timeout=120)
    assert "nowhere" in panel.status.value and "color:#c00" in panel.status.value
