"""Errors that reach the user as one message and exit code 2 (never a traceback)."""


class ConfigError(ValueError):
    """A configuration, a flag or a file the user gave is wrong or asks for what is not modelled.

    The message names the problem (the key by its full path, every factor of a product that does
    not multiply out); several problems are joined one per line.
    """

    def __init__(self, message: str | list[str]):
        lines = [message] if isinstance(message, str) else list(message)
        super().__init__("\n".join(lines))
        self.problems = lines

    def __reduce__(self):  # keep the list of problems across processes
        return (ConfigError, (self.problems,))
