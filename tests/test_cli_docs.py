"""docs/cli.md is generated from the Typer app by Typer's own docs generator (`make docs`); this
test regenerates it and fails when the committed file differs, so the reference cannot drift
from the commands' `--help`."""

from __future__ import annotations

import difflib
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs" / "cli.md"
# `make docs` runs `python -m typer` with these arguments, then the output file.
ARGS = ["resserve_export.cli", "utils", "docs", "--name", "resserve-export", "--output"]
# Rich renders the help texts for the generator: pin what could tie its output to the terminal.
ENV = {"TERMINAL_WIDTH": "80", "COLUMNS": "80", "NO_COLOR": "1"}


def generate(out: Path, **env: str) -> bytes:
    """Run `python -m typer resserve_export.cli utils docs …` in this process (no second
    interpreter, no second import of torch) and return the bytes it wrote."""
    import typer.cli
    from typer.testing import CliRunner

    result = CliRunner().invoke(typer.cli.app, [*ARGS, str(out)], env={**ENV, **env})
    assert result.exit_code == 0, f"Typer's docs generator failed:\n{result.output}"
    return out.read_bytes()


def test_cli_docs_match_the_app(tmp_path):
    generated = generate(tmp_path / "cli.md")
    committed = DOCS.read_bytes() if DOCS.exists() else b""
    if generated != committed:
        diff = "".join(difflib.unified_diff(
            committed.decode(errors="replace").splitlines(keepends=True), generated.decode(errors="replace").splitlines(keepends=True),
            "docs/cli.md (committed)", "docs/cli.md (generated)", n=1,
        ))
        lines = diff.splitlines(keepends=True)
        shown = "".join(lines[:40]) + (f"... {len(lines) - 40} more diff lines\n" if len(lines) > 40 else "")
        raise AssertionError(
            "docs/cli.md does not match the CLI's options and help texts: run `make docs` and commit docs/cli.md\n" + shown
        )


def test_cli_docs_do_not_depend_on_the_terminal(tmp_path):
    """Another terminal width gives the same bytes, so the committed file is the same on every
    machine that runs `make docs`."""
    assert generate(tmp_path / "wide.md", TERMINAL_WIDTH="200", COLUMNS="200") == generate(tmp_path / "narrow.md")
