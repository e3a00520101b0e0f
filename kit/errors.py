"""Errors the kit raises for bad input: shown to the user as one clear line, never a traceback."""

from __future__ import annotations

import difflib


class KitError(Exception):
    """A problem with the user's input (config, files, arguments) that they can fix."""


class ConfigError(KitError):
    """A config file or value that cannot be accepted."""


class DataError(KitError):
    """A dataset folder, image or caption that cannot be used."""


def did_you_mean(word: str, choices: list[str]) -> str:
    """`; did you mean 'x'?` naming the closest of `choices`, or nothing when none is close."""
    close = difflib.get_close_matches(word, choices, n=1)
    return f"; did you mean '{close[0]}'?" if close else ""
