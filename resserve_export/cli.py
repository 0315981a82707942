"""The `resserve-export` command line: a thin Typer layer over the package's pure functions."""

from __future__ import annotations

import os
import sys

import typer

from .commands import calibrate, inspect, pack, plan, size, verify
from .errors import UserError

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


def main(argv: list[str] | None = None) -> None:
    """Entry point: user errors become one line on stderr and a non-zero exit, never a traceback."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        app(args=argv, standalone_mode=False)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        print("error: interrupted; no output was written", file=sys.stderr)
        sys.exit(130)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except Exception as e:
        # Usage errors of Typer's click (vendored or not) know how to print themselves.
        if hasattr(e, "show") and hasattr(e, "exit_code"):
            e.show()
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            print("error: aborted", file=sys.stderr)
            sys.exit(1)
        raise

if __name__ == "__main__":
    main()
