"""The gateway as the proxy of a disaggregated deployment (xPyD), as vLLM's and vllm-ascend's proxies do it: each
request is prefilled on a prefill server (a Triton whose engine is a kv_producer), as the client sent it but with
max_tokens 1, then decoded on a decode server (a kv_consumer) given the kv_transfer_params the prefill returned; the
decode server pulls the prompt's KV and answers, and its answer is what the client gets (docs/disaggregation.md).

DisaggregatedClient has TritonClient's interface, so every endpoint works unchanged. Servers are picked by load: the
fewest requests this gateway has in flight on them (it is their only client in this layout), ties in turn.
"""
from __future__ import annotations

import contextlib
import itertools
import logging
from collections.abc import AsyncIterator

from backend.engine.kv_transfer.params import KVTransferParams
from backend.engine.sampling_params import SamplingParams
from backend.gateway.client import Chunk, InvalidRequest, TritonClient, TritonUnavailable

log = logging.getLogger(__name__)

# What a prefill asks for beside the client's request (as vLLM's proxy forwards it, so that the prefill server refuses
# a bad request before it holds any block; what only the decode server's limits catch, prompt + max_tokens, it refuses
# and releases the prefill itself): one token (which the decode server samples again, as vLLM's consumer does), the
# prompt's blocks kept for a consumer.
PREFILL = {"max_tokens": 1, "min_tokens": 0, "kv_transfer_params": KVTransferParams(do_remote_decode=True)}


class ServerPool:
    """The servers of one role, picked by load: the fewest requests this gateway has in flight on them, equals in a
    turn that moves on at each pick."""

    def __init__(self, urls: list[str], model: str):
        self.clients = [TritonClient(url, model) for url in urls]
        self.in_flight = {client.url: 0 for client in self.clients}
        self._turn = itertools.count()

    def by_load(self) -> list[TritonClient]:
        start = next(self._turn) % len(self.clients)
        rotated = self.clients[start:] + self.clients[:start]
        return sorted(rotated, key=lambda client: self.in_flight[client.url])  # (stable: equals keep the turn)

    @contextlib.contextmanager
    def busy(self, client: TritonClient):
        self.in_flight[client.url] += 1
        try:
            yield
        finally:
            self.in_flight[client.url] -= 1


class DisaggregatedClient:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], model: str):
        if not prefill_urls or not decode_urls:
            raise ValueError("a disaggregated gateway needs at least one --prefill and one --decode Triton URL")
        self.url = f"prefill {', '.join(prefill_urls)}; decode {', '.join(decode_urls)}"
        self.prefill, self.decode = ServerPool(prefill_urls, model), ServerPool(decode_urls, model)

    async def ready(self, timeout: float = 2.0) -> bool:
        """Every decode server is ready, and a prefill server (without one, decode servers prefill themselves)."""
        decode = [await client.ready(timeout) for client in self.decode.clients]
        prefill = [await client.ready(timeout) for client in self.prefill.clients]
        return all(decode) and any(prefill)

    async def close(self) -> None:
        for client in self.prefill.clients + self.decode.clients:
            await client.close()

    async def generate(self, prompt: str, params: SamplingParams, stream: bool, request_id: str,
                       prompt_token_ids: list[int] | None = None, lora_name: str | None = None,
                       images: list[str] = ()) -> AsyncIterator[Chunk]:
        """The decode server's responses, after a prefill elsewhere: the least loaded decode server that answers.
        A request the consumer side cannot take from a remote prefill (several samples, prompt logprobs) is decoded
        where it is prefilled: on a decode server. (Engines of a disaggregated deployment serve no adapters.)"""
        if lora_name is not None:
            raise InvalidRequest("LoRA adapters are not served with disaggregated prefill")
        if images:
            raise InvalidRequest("images are not served with disaggregated prefill")
        if params.kv_transfer_params is None and params.n == 1 and params.prompt_logprobs is None:
            params = _with_transfer(params, await self._prefill(prompt, params, request_id, prompt_token_ids))
        unavailable = None
        for decode in self.decode.by_load():
            answered = False
            try:
                with self.decode.busy(decode):
                    async with contextlib.aclosing(decode.generate(prompt, params, stream, request_id,
                                                                   prompt_token_ids)) as responses:
                        async for chunk in responses:
                            answered = True
                            yield chunk
                return
            except TritonUnavailable as e:
                if answered:  # (mid-answer: the client has part of it already)
                    raise
                log.warning("decode server %s is unavailable (%s); trying the next", decode.url, e)
                unavailable = e
                params = _with_transfer(params, None)  # (it may have pulled them already: the next one prefills itself)
        raise unavailable

    async def _prefill(self, prompt: str, params: SamplingParams, request_id: str,
                       prompt_token_ids: list[int] | None) -> dict | None:
        """The kv_transfer_params of the prompt's prefill, on the least loaded prefill server that answers; None
        (the decode server prefills) when none does. A request the prefill server rejects is rejected here."""
        prefill = params.model_copy(update=PREFILL)
        for client in self.prefill.by_load():
            try:
                with self.prefill.busy(client):
                    async with contextlib.aclosing(client.generate(prompt, prefill, False, f"{request_id}-prefill",
                                                                   prompt_token_ids)) as responses:
                        async for chunk in responses:
                            if chunk.final:
                                return chunk.kv_transfer_params
            except TritonUnavailable as e:
                log.warning("prefill server %s is unavailable (%s); trying the next", client.url, e)
        log.warning("no prefill server answered: request %s is prefilled on its decode server", request_id)
        return None

    async def admin(self, action: str, **arguments: str) -> dict:
        """engine_info from a decode server (theirs is the limit a client meets); a profile action on every server."""
        if arguments:
            raise InvalidRequest("LoRA adapters are not served with disaggregated prefill")
        if action == "engine_info":
            return await self.decode.clients[0].admin(action)
        return {client.url: await client.admin(action) for client in self.prefill.clients + self.decode.clients}


def _with_transfer(params: SamplingParams, transfer: dict | None) -> SamplingParams:
    """params with these kv_transfer_params (a prefill's answer, checked as the engine checks them), or none."""
    try:
        checked = None if transfer is None else KVTransferParams.model_validate(transfer)
    except ValueError as e:  # (pydantic's ValidationError): the decode server would refuse them so
        raise InvalidRequest(f"the prefill server's kv_transfer_params: {e}") from None
    return params.model_copy(update={"kv_transfer_params": checked})
