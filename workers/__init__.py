"""Worker process: one per vLLM engine (prefill or decode)."""
