"""What a resumable request's context carries beyond the response's description.

The context (:func:`proxy.resume.context_of`) is opaque to the workers: each
leg of a request carries it and a worker hands it back in
:class:`~star.wire.Attached`. A prompt's logprobs are computed once, with the
prompt, and sent to the proxy that runs the request alone; the run puts them
in the context of its later legs (:func:`with_prompt_logprobs`), so a proxy
that takes the stream over before its client has the first chunk (an echo
with logprobs starts with them) echoes the real ones
(:func:`prompt_logprobs_of`).
"""

from __future__ import annotations

import msgspec

from star.wire import PromptLogprobs


def with_prompt_logprobs(context: bytes, prompt: PromptLogprobs) -> bytes:
    """``context`` holding the prompt's logprobs too."""
    doc = msgspec.msgpack.decode(context)
    doc["prompt_logprobs"] = {
        "logprobs": list(prompt.logprobs),
        "ranks": list(prompt.ranks),
        "top_ids": list(prompt.top_ids),
        "top_logprobs": list(prompt.top_logprobs),
    }
    return msgspec.msgpack.encode(doc)


def prompt_logprobs_of(context: bytes) -> PromptLogprobs | None:
    """The prompt's logprobs ``context`` carries (None: not there)."""
    try:
        given = msgspec.msgpack.decode(context).get("prompt_logprobs")
        return None if given is None else PromptLogprobs(stream=0, **given)
    except (msgspec.DecodeError, TypeError, AttributeError):
        return None
