"""`resserve-export verify`."""

from ..errors import UserError


def command() -> None:
    """Not implemented yet."""
    raise UserError("'verify' is not implemented yet in this version")
