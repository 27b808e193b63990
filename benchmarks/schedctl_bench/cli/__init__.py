"""The `schedctl bench` commands: typer commands, registered on schedctl's root app by the
plugin entry point (schedctl_bench.cli.plugin)."""
