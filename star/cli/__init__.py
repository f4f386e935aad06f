"""The `star` command line."""
