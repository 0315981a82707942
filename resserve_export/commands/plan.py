"""`resserve-export plan`."""

from ..errors import UserError


def command() -> None:
    """Not implemented yet."""
    raise UserError("'plan' is not implemented yet in this version")
