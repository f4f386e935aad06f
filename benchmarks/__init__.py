"""Benchmarks behind `star bench`: each module exposes configure(parser) and run(args).

benchmarks.common holds what they share: the ``python -m`` entry point
(``bench_main``) and the text table (``text_table``).
"""
