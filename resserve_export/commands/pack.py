"""`resserve-export pack`."""

from ..errors import UserError


def command() -> None:
    """Not implemented yet."""
    raise UserError("'pack' is not implemented yet in this version")
