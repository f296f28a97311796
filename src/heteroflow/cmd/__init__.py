"""Command implementations behind the CLI entry points."""
