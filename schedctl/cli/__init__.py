"""The schedctl command-line interface (typer + rich)."""
