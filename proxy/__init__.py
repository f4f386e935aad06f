"""Proxy process: OpenAI-compatible HTTP/SSE front end."""
