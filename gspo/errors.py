"""Errors meant for people: the CLI prints them without a traceback."""


class ConfigError(ValueError):
    """A bad config value or command-line input. The CLI exits with code 2."""


class ReportedError(ConfigError):
    """A ConfigError whose message was already shown (by a torchrun worker): exit code 2, nothing repeated."""
