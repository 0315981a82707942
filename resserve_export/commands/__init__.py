"""One module per CLI command: a thin Typer function over pure functions elsewhere."""
