"""`resserve-export calibrate`."""

from ..errors import UserError


def command() -> None:
    """Not implemented yet."""
    raise UserError("'calibrate' is not implemented yet in this version")
