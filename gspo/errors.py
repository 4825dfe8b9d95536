"""Errors meant for people: the CLI prints them without a traceback."""


class ConfigError(ValueError):
    """A bad config value or command-line input. The CLI exits with code 2."""
