"""The error every entry point turns into one `error: ...` line and exit code 2."""


class ConfigError(ValueError):
    """An impossible or incomplete configuration, reported before anything is built."""
