"""Seeded sampling of a migrated request on vLLM's GPU samplers (issue 28; docs/design.md §5.2).

``check.py`` drives copies of vLLM 0.32.0's own sampling code (this folder,
origin in each file's header) on a GPU machine that has torch and Triton but
no vLLM; tests/workers/test_gpu_continuation.py runs it on the CPU.
"""
