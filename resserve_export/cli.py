"""The `resserve-export` command line: a thin Typer layer over the package's pure functions."""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperOption

from resserve_export.commands import calibrate, inspect, pack, plan, size, verify
from resserve_export.core.errors import UserError
from resserve_export.core.ui import say


def _no_placeholder_for_flags() -> None:
    """Help shows no ``<bool>`` after on/off flags (``--overwrite``, ``--json``, ``--help``):
    they take no value. Typer has no setting for this, so its option class is adjusted once."""

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "_resserve", False):
        return  # older Typer (no such hook): the help keeps its placeholders, nothing else changes

    def display_type_rich(self, ctx):
        return None if getattr(self, "is_flag", False) else shown(self, ctx)

    display_type_rich._resserve = True
    TyperOption.display_type_rich = display_type_rich


_no_placeholder_for_flags()

app = typer.Typer(
    name="resserve-export",
    help="Turn a Hugging Face LLM into an FP4 checkpoint with residue compensation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

app.command("calibrate")(calibrate.command)
app.command("plan")(plan.command)
app.command("pack")(pack.command)
app.command("size")(size.command)
app.command("inspect")(inspect.command)
app.command("verify")(verify.command)


INTERRUPTED = 130  # 128 + SIGINT, as shells report it


def _interrupted() -> None:
    say("interrupted: no output was written")
    sys.exit(INTERRUPTED)


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit, never a traceback.

    Exit codes: 0 success; 1 an aborted prompt; 2 a user error (bad input or usage); 3 `verify`
    found a checkpoint that does not match the model; 130 interrupted (Ctrl-C).
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        rc = app(args=argv, standalone_mode=False)
    except UserError as e:
        say(f"error: {e}")
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        _interrupted()
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except OSError as e:
        # Disk full, permissions, a vanished file, ... after the up-front checks: say which path.
        where = f" ({e.filename})" if e.filename else ""
        say(f"error: {e.strerror or e}{where}: check the path, its permissions and free space")
        sys.exit(1)
    except Exception as e:
        # Usage errors of Typer's click (vendored or not) know how to print themselves.
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            say("error: aborted")
            sys.exit(1)
        raise
    # Without standalone mode Typer turns Ctrl-C into a returned 130 (and any typer.Exit raised
    # by a command into its code): never let it end as a silent success.
    if rc == INTERRUPTED:
        _interrupted()
    if isinstance(rc, int) and not isinstance(rc, bool) and rc != 0:
        sys.exit(rc)


if __name__ == "__main__":
    main()
