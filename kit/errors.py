"""Errors the kit raises for bad input: shown to the user as one clear line, never a traceback."""

from __future__ import annotations


class KitError(Exception):
    """A problem with the user's input (config, files, arguments) that they can fix."""


class ConfigError(KitError):
    """A config file or value that cannot be accepted."""


class DataError(KitError):
    """A dataset folder, image or caption that cannot be used."""
