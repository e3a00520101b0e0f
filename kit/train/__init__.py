"""The training loop: prepare, fit, one micro-step; resume, accelerate, objective."""
