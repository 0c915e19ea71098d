"""The errors every entry point turns into one `error: ...` line: ConfigError (exit code 2)
and TrainingError (a run that cannot go on, exit code 1)."""


class ConfigError(ValueError):
    """An impossible or incomplete configuration, reported before anything is built."""


class TrainingError(RuntimeError):
    """A run that cannot go on (divergence, out of memory): one line with what to do."""
