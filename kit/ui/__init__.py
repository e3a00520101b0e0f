"""Notebook front-ends: widgets, config forms, the training panel, headless runs."""
