"""vLLM's own path from the engine's logprob arrays to a response's logprobs object.

The reference the proxy's rendering (:mod:`proxy.logprobs`) is held to: its
``LogprobsProcessor`` names the tokens with the model's Hugging Face
tokenizer (as the engine of vLLM's server does), and its servers'
``_create_completion_logprobs`` / ``_create_chat_logprobs`` build the object.
vLLM is imported when :func:`vllm_renderer` is called.
"""

from __future__ import annotations

import json
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Row = tuple[int, float, Sequence[tuple[int, float]]]
"""One generated position: the sampled id, its logprob, the top k (id, logprob) in rank order."""
Render = Callable[[bool, int, Sequence[Row], bool], Any]
"""``render(chat, top, rows, as_ids)``: the logprobs object vLLM's server writes, as JSON
values (``as_ids``: the request's ``return_tokens_as_token_ids``)."""


def vllm_renderer(model_dir: Path) -> Render:
    """A :data:`Render` with the tokenizer of the model in ``model_dir``."""
    import numpy as np
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import create_sample_logprobs
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    hf = get_tokenizer(str(model_dir))
    # What the two methods read of their server: its token-id option and helpers.
    server: Any = types.SimpleNamespace(
        return_tokens_as_token_ids=False,
        _get_decoded_token=GenerateBaseServing._get_decoded_token,
    )
    server._get_top_logprobs = lambda *a, **kw: OpenAIServingChat._get_top_logprobs(
        server, *a, **kw
    )

    def render(chat: bool, top: int, rows: Sequence[Row], as_ids: bool = False) -> Any:
        proc = LogprobsProcessor(
            tokenizer=hf,
            logprobs=create_sample_logprobs(False),
            prompt_logprobs=None,
            cumulative_logprob=0.0,
            num_logprobs=top,
            num_prompt_logprobs=None,
        )
        for tid, lp, tops in rows:  # one engine step per token, as the sampler writes it
            proc._update_sample_logprobs(
                LogprobsLists(
                    np.array([[tid, *(t for t, _ in tops)]]),
                    np.array([[lp, *(v for _, v in tops)]], dtype=np.float32),
                    np.array([1]),
                )
            )
        ids = [tid for tid, _, _ in rows]
        logprobs: Any = proc.logprobs
        out: Any
        if chat:
            out = OpenAIServingChat._create_chat_logprobs(
                server, ids, logprobs, hf, num_output_top_logprobs=top, return_as_token_id=as_ids
            )
        else:
            out = OpenAIServingCompletion._create_completion_logprobs(
                server, ids, logprobs, top, hf, return_as_token_id=as_ids
            )
        return json.loads(out.model_dump_json())

    return render


PromptRow = tuple[int, float, int, Sequence[tuple[int, float]]]
"""One scored prompt position: the prompt token, its logprob and rank, the top k (id, logprob)."""
PromptRender = Callable[[Sequence[int], int, Sequence[PromptRow], Sequence[Row], int, bool], Any]
"""``render(prompt, k, prompt_rows, output_rows, logprobs, as_ids)``: what vLLM's server writes for a
request with ``prompt_logprobs: k`` whose output rows were scored with ``logprobs`` top tokens:
``{"prompt_logprobs": <the response field>, "echo": <completions' echo logprobs object>}``."""


def vllm_prompt_renderer(model_dir: Path) -> PromptRender:
    """A :data:`PromptRender` with the tokenizer of the model in ``model_dir``.

    vLLM's engine (``LogprobsProcessor._update_prompt_logprobs``, as the
    server's engine runs it: ``flat_logprobs`` off) builds the prompt
    logprobs from the tensors its model runner writes; the completion
    server's non-streamed path clamps them (``clamp_prompt_logprobs``) into
    the choice's ``prompt_logprobs`` and, with ``echo``, renders prompt and
    output together (``_create_completion_logprobs``).
    """
    import numpy as np
    import torch
    from vllm.entrypoints.generate.base.serving import GenerateBaseServing, clamp_prompt_logprobs
    from vllm.entrypoints.openai.completion.protocol import CompletionResponseChoice
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.logprobs import create_prompt_logprobs, create_sample_logprobs
    from vllm.tokenizers import get_tokenizer
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists, LogprobsTensors

    hf = get_tokenizer(str(model_dir))
    server: Any = types.SimpleNamespace(
        return_tokens_as_token_ids=False,
        _get_decoded_token=GenerateBaseServing._get_decoded_token,
    )

    def render(
        prompt: Sequence[int],
        k: int,
        prompt_rows: Sequence[PromptRow],
        output_rows: Sequence[Row],
        logprobs: int,
        as_ids: bool = False,
    ) -> Any:
        proc = LogprobsProcessor(
            tokenizer=hf,
            logprobs=create_sample_logprobs(False),
            prompt_logprobs=create_prompt_logprobs(False),
            cumulative_logprob=0.0,
            num_logprobs=logprobs,
            num_prompt_logprobs=k,
        )
        # The model runner's prompt tensors: [prompt token, top k] per scored position.
        ids = torch.tensor([[tid, *(t for t, _ in tops)] for tid, _, _, tops in prompt_rows])
        values = torch.tensor(
            [[lp, *(v for _, v in tops)] for _, lp, _, tops in prompt_rows], dtype=torch.float32
        )
        ranks = torch.tensor([rank for _, _, rank, _ in prompt_rows])
        proc._update_prompt_logprobs(LogprobsTensors(ids, values, ranks))
        for tid, lp, tops in output_rows:
            proc._update_sample_logprobs(
                LogprobsLists(
                    np.array([[tid, *(t for t, _ in tops)]]),
                    np.array([[lp, *(v for _, v in tops)]], dtype=np.float32),
                    np.array([1]),
                )
            )
        prompt_lps = clamp_prompt_logprobs(proc.pop_prompt_logprobs())
        assert prompt_lps is not None
        # The server's JSONResponse(content=response.model_dump()): json.dumps of it.
        choice = CompletionResponseChoice(index=0, text="", prompt_logprobs=prompt_lps)
        field = json.loads(json.dumps(choice.model_dump()["prompt_logprobs"], allow_nan=False))
        out_ids = [tid for tid, _, _ in output_rows]
        echo = OpenAIServingCompletion._create_completion_logprobs(
            server,
            [*prompt, *out_ids],
            [*prompt_lps, *proc.logprobs],
            logprobs,
            hf,
            return_as_token_id=as_ids,
        )
        return {"prompt_logprobs": field, "echo": json.loads(echo.model_dump_json())}

    return render
