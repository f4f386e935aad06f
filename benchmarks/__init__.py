"""Benchmarks behind `star bench`: each module exposes configure(parser) and run(args)."""
