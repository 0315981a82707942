"""User-facing errors: one line that says what is wrong and what to do."""


class UserError(Exception):
    """An error caused by the user's input. The CLI prints it on one line and exits non-zero."""

    exit_code = 2

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class CheckpointMismatch(UserError):
    """The stored weights differ from a fresh quantization of the given model.

    Its own exit code (3) lets scripts tell "this checkpoint was not packed from this model"
    apart from a usage or input error (2).
    """

    exit_code = 3
