"""`resserve-export size`."""

from ..errors import UserError


def command() -> None:
    """Not implemented yet."""
    raise UserError("'size' is not implemented yet in this version")
