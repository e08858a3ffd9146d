"""The `loomserve` command line."""
