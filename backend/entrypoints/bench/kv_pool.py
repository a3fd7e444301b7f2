"""`npu-llm bench kv-pool`: multi-turn chat whose turns come back after other conversations pushed them out of the
device's KV cache, with a KV pool against without one: time to first token and prompt tokens computed per turn.

Conversations share a long system prompt; each turn adds a user message to the conversation so far (the replies
are the model's own, greedy). Turns are taken conversation by conversation, one request at a time, so a turn's TTFT
is its prefill alone, and the KV cache holds only a few conversations: by the time a conversation's next turn comes,
its history has left the device's cache (the shared system prompt, used by every turn, stays). Three set-ups, the
same model and turns, run one after the other in this process:
- `none`: one engine, no pool: each turn computes its history again.
- `offload`: one engine with CPU offload (kv_offloading_size): the history comes back from host memory.
- `store` (with --instances 2): two engines behind a round-robin, as two instances behind the gateway, sharing a
  Mooncake Store (a mooncake_master started here), against the same two engines without it (`none x2`). A turn
  lands on the other engine than the last: only the pool holds that conversation there.
One JSON line; only the ratios mean anything across machines."""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from backend.config import EngineConfig
from backend.config.addresses import free_port
from backend.config.kv_transfer import MOONCAKE_CONFIG_ENV
from backend.engine.engine import LLMEngine
from backend.engine.sampling_params import SamplingParams
from backend.entrypoints.bench.speculative import PASSAGES

QUESTIONS = ["Summarise the last answer in one sentence.", "What should I do first?", "Why does that matter?",
             "Give me one more example.", "What could go wrong?", "How long will it take?"]


def system_prompt(tokenizer, num_tokens: int) -> str:
    """A system prompt of about num_tokens tokens: an assistant's instructions, then reference passages."""
    text = "You are a helpful assistant. Answer from the reference material below, briefly.\n\n"
    i = 0
    while len(tokenizer.encode(text)) < num_tokens:
        text += f"Reference {i + 1}: {PASSAGES[i % len(PASSAGES)]}\n"
        i += 1
    return text


class Chats:
    """The conversations' messages so far, and each turn's prompt token ids."""

    def __init__(self, tokenizer, system: str, num_conversations: int):
        self.tokenizer = tokenizer
        self.messages = [[{"role": "system", "content": system}] for _ in range(num_conversations)]

    def ask(self, conversation: int, turn: int) -> list[int]:
        question = f"(Conversation {conversation}) {QUESTIONS[turn % len(QUESTIONS)]}"
        self.messages[conversation].append({"role": "user", "content": question})
        text = self.tokenizer.apply_chat_template(self.messages[conversation], add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def answer(self, conversation: int, token_ids: list[int]) -> None:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        self.messages[conversation].append({"role": "assistant", "content": text})


def timed_turn(engine: LLMEngine, request_id: str, prompt_ids: list[int], max_tokens: int):
    """(TTFT in s, prompt tokens computed, the reply's token ids) of one request run alone."""
    computed = engine.scheduler.num_computed_tokens
    sent = time.perf_counter()
    engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0,
                                                                                   max_tokens=max_tokens))
    ttft = prefill = None
    while True:
        for output in engine.step():
            if output.request_id != request_id:
                continue
            if ttft is None and output.outputs[0].token_ids:
                ttft = time.perf_counter() - sent
                prefill = engine.scheduler.num_computed_tokens - computed
            if output.finished:
                return ttft, prefill, output.outputs[0].token_ids
        if failure := engine.take_failures().get(request_id):
            raise RuntimeError(f"turn {request_id} failed: {failure}")


def run_chats(engines: list[LLMEngine], args, label: str) -> dict:
    """Every turn of every conversation, turn by turn, each turn of a conversation on the next engine."""
    tokenizer = engines[0].tokenizer
    chats = Chats(tokenizer, system_prompt(tokenizer, args.system_tokens), args.conversations)
    ttfts, prefills, replies = [], [], []
    for turn in range(args.turns):
        for conversation in range(args.conversations):
            engine = engines[(conversation + turn) % len(engines)]  # (with two: the other one than last turn)
            asked = chats.ask(conversation, turn)
            ttft, prefill, reply = timed_turn(engine, f"{label}-{conversation}-{turn}", asked, args.output_len)
            chats.answer(conversation, reply)
            if turn:  # (the first turns fill the caches; the pool pays on the turns that come back)
                ttfts.append(ttft)
                prefills.append(prefill)
            replies.append((asked, reply))
    for engine in engines:
        while engine.scheduler.has_pending_transfers:  # (the last saves)
            engine.step()
    stats = [e.kv_connector.stats for e in engines if e.kv_connector is not None]
    return {"mean_ttft_s": round(statistics.mean(ttfts), 4),
            "p90_ttft_s": round(statistics.quantiles(ttfts, n=10)[-1], 4),
            "prompt_tokens_computed": sum(prefills),
            "pool_hit_tokens": sum(s.external_hits for s in stats),
            "replies": replies}


def _engines(config: EngineConfig, count: int, **overrides) -> list[LLMEngine]:
    return [LLMEngine(EngineConfig(**{**config.to_dict(), **overrides})) for _ in range(count)]


def _compare(result: dict, name: str, baseline: dict, pooled: dict) -> None:
    """The ratios, and how many turns that got the same prompt in both runs got the same reply. (A reply that differs
    changes its conversation's later prompts: in bf16 a prompt computed in pieces rounds otherwise than at once.)"""
    same = [(a[1], b[1]) for a, b in zip(baseline.pop("replies"), pooled.pop("replies")) if a[0] == b[0]]
    result[name] = {
        "without": baseline, "with": pooled,
        "mean_ttft_ratio": round(pooled["mean_ttft_s"] / baseline["mean_ttft_s"], 3),
        "p90_ttft_ratio": round(pooled["p90_ttft_s"] / baseline["p90_ttft_s"], 3),
        "prompt_tokens_ratio": round(pooled["prompt_tokens_computed"] / baseline["prompt_tokens_computed"], 3),
        "identical_replies": f"{sum(a == b for a, b in same)} of {len(same)} turns asked the same",
    }


def run_kv_pool_bench(args) -> dict:
    config = EngineConfig.from_cli_args(args)
    config.num_kv_blocks = config.num_kv_blocks or args.kv_blocks
    result = {"model": config.model, "dtype": config.dtype, "num_kv_blocks": config.num_kv_blocks,
              "conversations": args.conversations, "turns": args.turns, "system_tokens": args.system_tokens,
              "output_len": args.output_len}

    def measured(engines, label):
        try:
            timed_turn(engines[0], f"{label}-warm-up", [1, 2, 3, 4], 2)
            return run_chats(engines, args, label)
        finally:
            for engine in engines:
                engine.shutdown()

    plain = measured(_engines(config, 1, kv_offloading_size=None), "none")
    offload = measured(_engines(config, 1, kv_offloading_size=args.offload_gb), "offload")
    _compare(result, "offload", plain, offload)
    if args.instances > 1:
        plain = measured(_engines(config, args.instances, kv_offloading_size=None), "none-x")
        store = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}
        result["store"] = _with_master(lambda: measured(
            _engines(config, args.instances, kv_offloading_size=None, kv_transfer_config=store), "store"))
        _compare(result, "store", plain, result["store"])
    print(json.dumps(result), flush=True)
    return result


def _with_master(run):
    """run() with a mooncake_master of its own on free loopback ports, its engines lending 512 MiB each."""
    from backend.entrypoints.kv_pool_master import start_master
    from backend.entrypoints.serve import stop_process_group

    rpc, admin = free_port(), free_port()
    master = start_master(rpc, admin)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "mooncake.json"
        path.write_text(json.dumps({"master_server_address": f"127.0.0.1:{rpc}", "global_segment_size": "512MB"}))
        saved = os.environ.get(MOONCAKE_CONFIG_ENV)
        os.environ[MOONCAKE_CONFIG_ENV] = str(path)
        try:
            return run()
        finally:
            if saved is None:
                os.environ.pop(MOONCAKE_CONFIG_ENV)
            else:
                os.environ[MOONCAKE_CONFIG_ENV] = saved
            stop_process_group(master)
