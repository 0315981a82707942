"""`resserve-export inspect`."""

from ..errors import UserError


def command() -> None:
    """Not implemented yet."""
    raise UserError("'inspect' is not implemented yet in this version")
