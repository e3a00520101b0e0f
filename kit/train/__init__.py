"""The training loop: prepare, fit, one micro-step; resume, accelerate, objective."""

from kit.train.loop import StopTraining, TrainResult, train

__all__ = ["StopTraining", "TrainResult", "train"]
