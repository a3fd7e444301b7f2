"""POST /tokenize and /detokenize, as vLLM's server answers them: the served tokenizer, and for messages the same
chat template (and tools) a chat completion would render, encoded as the engine encodes it, so `count` is the
prompt_tokens it would use."""
from __future__ import annotations

import asyncio
import concurrent.futures

from starlette.responses import JSONResponse, Response

from backend.engine.tokenizer import encode_prompt
from backend.gateway.errors import ApiError, triton_errors
from backend.gateway.protocol_tokenize import DetokenizeRequest, TokenizeRequest
from backend.gateway.serving import Serving
from backend.gateway.tools import render_prompt


# Rendering and encoding a body's worth of text takes a while: on a worker thread, so open streams go on meanwhile;
# one /tokenize at a time (the event loop's own uses of the tokenizer, chat rendering and decoding, only read it).
_TOKENIZING = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="npu-llm-tokenize")


async def tokenize(serving: Serving, req: TokenizeRequest) -> Response:
    ids, strs = await asyncio.get_running_loop().run_in_executor(_TOKENIZING, _tokens, serving.tokenizer, req)
    return JSONResponse({"count": len(ids), "max_model_len": await _max_model_len(serving), "tokens": ids,
                         "token_strs": strs})


def _tokens(tokenizer, req: TokenizeRequest) -> tuple[list[int], list[str] | None]:
    """The ids the request's text or messages make, and their strings when it asks for them."""
    if req.messages is not None:
        try:
            text = render_prompt(tokenizer, [m.for_template() for m in req.messages], req.tools,
                                 req.chat_template_kwargs, req.add_generation_prompt is not False)
        except Exception as e:  # the template itself rejects the conversation
            raise ApiError(400, f"messages: {e}", param="messages") from None
    else:
        text = req.prompt
    # unless asked otherwise, the ids the engine would make of this text (what prompt_tokens counts)
    if req.add_special_tokens is None:
        ids = encode_prompt(tokenizer, text)
    else:
        ids = tokenizer.encode(text, add_special_tokens=req.add_special_tokens)
    return ids, tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None


def detokenize(serving: Serving, req: DetokenizeRequest) -> Response:
    size = len(serving.tokenizer)
    outside = next((i for i, t in enumerate(req.tokens) if t >= size), None)
    if outside is not None:
        raise ApiError(400, f"tokens.{outside}: {req.tokens[outside]} is outside the vocabulary ({size} tokens)",
                       param=f"tokens.{outside}")
    return JSONResponse({"prompt": serving.tokenizer.decode(req.tokens)})


async def _max_model_len(serving: Serving) -> int:
    """The engine's max_model_len, asked of the Triton model once."""
    if serving.max_model_len is None:
        with triton_errors():
            serving.max_model_len = (await serving.triton.admin("engine_info"))["max_model_len"]
    return serving.max_model_len
