"""Disaggregated prefill between two real engines (backend/engine/kv_transfer/): a producer prefills, a consumer
pulls the prompt's KV with Mooncake's transfer engine over TCP and decodes. Greedy outputs in fp32 are those of a
colocated engine; every block returns to its pool on both sides; wrong kv_transfer_params fail their own request."""
from __future__ import annotations

import os
import socket
import sys
import threading
import time

import pytest
import torch

from backend.config import EngineConfig
from backend.config.control_key import CONTROL_KEY_ENV
from backend.engine.engine import LLMEngine
from backend.engine.kv_transfer import mooncake
from backend.engine.kv_transfer.params import KVTransferParams
from backend.engine.kv_transfer.transfer_engine import start_transfer_engine
from backend.engine.sampling_params import SamplingParams

BLOCK = 16
COMMON = dict(dtype="float32", block_size=BLOCK, num_kv_blocks=96, max_model_len=512)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_config(role: str, engine_id: str, **extra) -> dict:
    return {"kv_connector": "MooncakeConnectorV1", "kv_role": role, "kv_port": free_port(), "engine_id": engine_id,
            **extra}


TEST_CONTROL_KEY = "disaggregation-test-key"


def signed(params: dict, key: str = TEST_CONTROL_KEY) -> dict:
    """params as a producer holding key signs them (a test's changed params, or an outsider's with another key)."""
    return KVTransferParams.model_validate(params).signed_with(key).model_dump()


@pytest.fixture(scope="module")
def engines(tiny_llama_dir, default_model_dir):
    """(producer, consumer, colocated), in a deployment whose control key is TEST_CONTROL_KEY."""
    before = os.environ.get(CONTROL_KEY_ENV)
    os.environ[CONTROL_KEY_ENV] = TEST_CONTROL_KEY
    common = dict(COMMON, model=str(tiny_llama_dir), tokenizer=str(default_model_dir))
    producer = LLMEngine(EngineConfig(**common, kv_transfer_config=kv_config(
        "kv_producer", "prefill-0", kv_connector_extra_config={"abort_timeout_s": 3})))
    consumer = LLMEngine(EngineConfig(**common, kv_transfer_config=kv_config("kv_consumer", "decode-0")))
    colocated = LLMEngine(EngineConfig(**common))
    yield producer, consumer, colocated
    for engine in (producer, consumer, colocated):
        engine.shutdown()
    if before is None:
        del os.environ[CONTROL_KEY_ENV]
    else:
        os.environ[CONTROL_KEY_ENV] = before


def submit(engine, request_id, prompt_ids, **params) -> None:
    """Queue a greedy request of these token ids."""
    engine.add_request(request_id, {"prompt_token_ids": prompt_ids}, SamplingParams(temperature=0, **params))


def run(engine, request_id, prompt_ids, **params):
    """The request's final output, stepping the engine until it ends; its error if it failed."""
    submit(engine, request_id, prompt_ids, **params)
    for _ in range(10_000):
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                return output
        failures = engine.take_failures()
        if request_id in failures:
            return failures[request_id]
    raise AssertionError(f"request {request_id} never finished")


def settle(*engines):
    """Step until no engine has requests or transfers left."""
    for _ in range(10_000):
        busy = [e for e in engines if e.has_unfinished_requests()]
        if not busy:
            return
        for engine in busy:
            engine.step()
    raise AssertionError("transfers never ended")


def prefill(producer, request_id, prompt_ids) -> dict:
    output = run(producer, request_id, prompt_ids, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert output.kv_transfer_params["do_remote_prefill"], output
    return output.kv_transfer_params


def assert_decodes_as_colocated(consumer, colocated, name: str, ids: list[int], params: dict, max_tokens: int):
    """The consumer's greedy tokens, given the prefill's params, are the colocated engine's; its output."""
    decoded = run(consumer, f"d-{name}", ids, max_tokens=max_tokens, kv_transfer_params=params)
    reference = run(colocated, f"c-{name}", ids, max_tokens=max_tokens)
    assert decoded.outputs[0].token_ids == reference.outputs[0].token_ids, name
    return decoded


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 7919 + i * 104729) % 200 + 3 for i in range(length)]


def assert_all_blocks_free(*engines):
    for engine in engines:
        assert engine.kv.num_free_blocks == engine.kv.num_blocks
        assert not engine.scheduler.loading and not engine.scheduler.sending


def test_consumer_decodes_the_producers_prefill_as_a_colocated_engine_would(engines):
    producer, consumer, colocated = engines
    shared = prompt(9, 3 * BLOCK)
    prompts = {
        "short": prompt(1, 5),  # less than a block
        "one-block": prompt(2, BLOCK),  # exactly one: the consumer recomputes its last token inside the pulled block
        "long": prompt(3, 7 * BLOCK + 3),  # several blocks, the last partial
        "prefix-a": shared + prompt(4, 20),
        "prefix-b": shared + prompt(5, 11),  # its 3 shared blocks are in the consumer's cache by then: not pulled
    }
    before = consumer.kv_connector.stats.copy()
    for name, ids in prompts.items():
        params = prefill(producer, f"p-{name}", ids)
        assert params["remote_engine_id"] == "prefill-0" and len(params["remote_block_ids"]) == -(-len(ids) // BLOCK)
        decoded = assert_decodes_as_colocated(consumer, colocated, name, ids, params, 20)
        if name == "prefix-b":
            assert decoded.metrics.num_cached_tokens == 3 * BLOCK
    settle(producer, consumer)
    stats = consumer.kv_connector.stats
    expected_blocks = sum(-(-len(ids) // BLOCK) for ids in prompts.values()) - 3
    assert stats.pulls - before.pulls == len(prompts) and stats.failures == before.failures
    assert stats.blocks - before.blocks == expected_blocks
    assert stats.bytes - before.bytes == expected_blocks * consumer.runner.bytes_per_block(consumer.model, BLOCK)
    # the consumer ran each prompt's last token only, never the pulled ones
    assert_all_blocks_free(producer, consumer)


def test_requests_decode_while_another_is_pulled(engines):
    producer, consumer, colocated = engines
    ids = [prompt(10 + i, 2 * BLOCK + i) for i in range(4)]
    params = [prefill(producer, f"p-batch-{i}", p) for i, p in enumerate(ids)]
    for i, p in enumerate(ids):
        submit(consumer, f"d-batch-{i}", p, max_tokens=12, kv_transfer_params=params[i])
    submit(consumer, "local", prompt(20, 30), max_tokens=12)
    outputs = {}
    while consumer.has_unfinished_requests():
        outputs.update({o.request_id: o for o in consumer.step() if o.finished})
    for i, p in enumerate(ids):
        assert outputs[f"d-batch-{i}"].outputs[0].token_ids == run(colocated, f"c-batch-{i}", p, max_tokens=12).outputs[0].token_ids
    assert outputs["local"].outputs[0].token_ids == run(colocated, "c-local", prompt(20, 30), max_tokens=12).outputs[0].token_ids
    settle(producer, consumer)
    assert_all_blocks_free(producer, consumer)


@pytest.mark.parametrize("change, message", [
    ({"remote_request_id": "nobody"}, "holds no prefill of request 'nobody'"),
    ({"remote_block_ids": "shifted"}, "are not the blocks"),
    ({"remote_engine_id": "prefill-9"}, "name engine 'prefill-9'"),
    ({"prompt": "other"}, "not the one engine 'prefill-0' prefilled"),
])
def test_a_claim_the_producer_refuses_fails_only_its_request(engines, change, message):
    producer, consumer, _ = engines
    ids = prompt(30, 2 * BLOCK + 5)
    params = prefill(producer, f"p-refused-{len(change)}-{message[:8]}", ids)
    wrong = dict(params)
    asked = list(ids)
    for key, value in change.items():
        if key == "prompt":
            asked[3] += 1
        elif value == "shifted":
            wrong[key] = [b + 1 for b in params["remote_block_ids"]]
        else:
            wrong[key] = value
    submit(consumer, "bystander", prompt(31, 20), max_tokens=8)
    error = run(consumer, "refused", asked, max_tokens=8, kv_transfer_params=signed(wrong))
    assert isinstance(error, ValueError) and message in str(error), error
    # the right params still work: a refused claim takes nothing from the producer
    assert run(consumer, "accepted", ids, max_tokens=8, kv_transfer_params=params).finished
    settle(producer, consumer)
    assert_all_blocks_free(producer, consumer)


def test_an_unreachable_producer_means_the_prompt_is_computed_here(engines, monkeypatch):
    producer, consumer, colocated = engines
    monkeypatch.setattr(mooncake, "SIDE_CHANNEL_TIMEOUT_S", 0.5)
    ids = prompt(40, 3 * BLOCK + 1)
    params = signed(dict(prefill(producer, "p-gone", ids), remote_host="127.0.0.1", remote_port=free_port()))
    failures = consumer.kv_connector.stats.failures
    assert_decodes_as_colocated(consumer, colocated, "gone", ids, params, 10)
    assert consumer.kv_connector.stats.failures == failures + 1
    settle(producer, consumer)  # the producer frees its blocks when nobody claims them (abort_timeout_s=3)
    assert producer.kv_connector.stats.expired >= 1
    assert_all_blocks_free(producer, consumer)


def test_a_producer_outside_the_deployment_is_refused_and_nothing_of_it_cached(engines):
    """Params from a producer without the deployment's key (a fake one serving made-up KV for a shared prompt) are
    refused before any pull; the consumer caches nothing of it, and computes the prompt itself when asked plainly."""
    producer, consumer, colocated = engines
    ids = prompt(47, 3 * BLOCK)
    params = prefill(producer, "p-outsider", ids)
    for forged in (signed(params, "an-outsiders-key"), {k: v for k, v in params.items() if k != "remote_signature"},
                   dict(params, remote_host="10.9.9.9")):
        with pytest.raises(ValueError, match="not signed by a producer of this deployment"):
            submit(consumer, "d-outsider", ids, max_tokens=4, kv_transfer_params=forged)
    pulls = consumer.kv_connector.stats.pulls
    plain = run(consumer, "d-plain", ids, max_tokens=4)
    assert plain.metrics.num_cached_tokens == 0 and consumer.kv_connector.stats.pulls == pulls
    settle(producer, consumer)  # (the producer frees the unclaimed prefill after its timeout)
    assert_all_blocks_free(producer, consumer)


def test_a_request_the_consumer_refuses_releases_the_producers_blocks_at_once(engines):
    """A decode refusal (prompt + max_tokens beyond max_model_len) frees the prefill held for it within a second,
    not at the producer's timeout: a client repeating it cannot pin the producer's cache."""
    producer, consumer, _ = engines
    ids = prompt(65, 2 * BLOCK)
    params = prefill(producer, "p-refused-decode", ids)
    expired = producer.kv_connector.stats.expired
    with pytest.raises(ValueError, match="exceeds max_model_len"):
        submit(consumer, "d-too-long", ids, max_tokens=600, kv_transfer_params=params)
    deadline = time.monotonic() + 1
    while "p-refused-decode" in producer.scheduler.sending and time.monotonic() < deadline:
        producer.step()
        time.sleep(0.02)
    assert "p-refused-decode" not in producer.scheduler.sending
    assert producer.kv_connector.stats.expired == expired  # released by the consumer, not by the timeout
    assert_all_blocks_free(producer, consumer)


def test_a_producer_holds_unclaimed_prefills_in_half_its_cache_at_most(engines):
    producer, consumer, _ = engines
    for i in range(3):  # 16 blocks each: half of the producer's 96
        prefill(producer, f"p-pin-{i}", prompt(70 + i, 16 * BLOCK))
    beyond = run(producer, "p-pin-3", prompt(73, 16 * BLOCK), max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    assert beyond.finished and beyond.kv_transfer_params is None  # answered; its decode server computes the prompt
    assert set(producer.scheduler.sending) == {f"p-pin-{i}" for i in range(3)}
    settle(producer, consumer)  # (nobody claims them: freed after abort_timeout_s)
    assert_all_blocks_free(producer, consumer)


def test_a_claim_after_the_timeout_means_the_prompt_is_computed_here(engines):
    producer, consumer, colocated = engines
    ids = prompt(45, 2 * BLOCK + 3)
    params = prefill(producer, "p-late", ids)
    expired = producer.kv_connector.stats.expired
    settle(producer)  # (nobody claims it: freed after abort_timeout_s)
    assert producer.kv_connector.stats.expired == expired + 1
    failures = consumer.kv_connector.stats.failures
    assert_decodes_as_colocated(consumer, colocated, "late", ids, params, 10)  # not refused: timed out
    assert consumer.kv_connector.stats.failures == failures + 1
    settle(producer, consumer)
    assert_all_blocks_free(producer, consumer)


def test_abort_before_the_pull_releases_the_producers_blocks(engines):
    producer, consumer, _ = engines
    ids = prompt(55, 2 * BLOCK)
    params = prefill(producer, "p-never-pulled", ids)
    # an aborted request that names that prefill with another prompt may not release it
    impostor = [ids[0] + 1, *ids[1:]]
    submit(consumer, "d-impostor", impostor, max_tokens=8, kv_transfer_params=params)
    consumer.abort_request("d-impostor")
    time.sleep(0.5)  # (its release is sent from a pull thread, and refused)
    producer.step()
    assert "p-never-pulled" in producer.scheduler.sending
    # the request it was made for, aborted while still queued (no blocks, no claim yet), releases it
    submit(consumer, "d-never-pulled", ids, max_tokens=8, kv_transfer_params=params)
    consumer.abort_request("d-never-pulled")
    expired = producer.kv_connector.stats.expired
    settle(producer, consumer)
    assert producer.kv_connector.stats.expired == expired  # released by the consumer, not by the timeout
    assert_all_blocks_free(producer, consumer)


def test_the_side_channel_survives_a_malformed_message(engines):
    import zmq

    producer, consumer, colocated = engines
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{producer.config.kv_transfer.kv_port}")
    peer.send(b"not an envelope")  # (one frame, no REQ envelope)
    peer.send_multipart([b"", b"{not json"])
    assert peer.poll(5000) and b"refused" in peer.recv_multipart()[-1]
    peer.close()
    ids = prompt(56, 2 * BLOCK)
    assert_decodes_as_colocated(consumer, colocated, "after-junk", ids, prefill(producer, "p-after-junk", ids), 6)
    settle(producer, consumer)
    assert_all_blocks_free(producer, consumer)


def test_the_side_channel_drops_an_oversized_frame_and_refuses_mistyped_fields(engines, caplog):
    """A 64 MiB frame is dropped at the socket (the producer never holds it), a field of the wrong type (an
    unhashable request id) is refused by name without a traceback, and pulls go on as before."""
    import zmq

    from backend.engine.kv_transfer import side_channel

    producer, consumer, colocated = engines
    port = producer.config.kv_transfer.kv_port
    peer = zmq.Context.instance().socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(f"tcp://127.0.0.1:{port}")
    peer.send_multipart([b"", b"[" + b"1," * (32 << 20) + b"1]"])
    assert not peer.poll(2000)  # dropped with its connection: no answer
    peer.close()
    for request, field in (({"op": "claim", "request_id": ["unhashable"]}, "request_id"),
                           ({"op": "claim", "request_id": "r", "block_ids": [1, "2"]}, "block_ids"),
                           ({"op": "layout", "extra": 1}, "extra")):
        answer = side_channel.call("127.0.0.1", port, request, timeout_s=10)
        assert answer["refused"] and repr(field) in answer["error"], answer
    assert not [r for r in caplog.records if r.exc_info], "a peer's message logged a traceback"
    ids = prompt(57, 2 * BLOCK)
    assert_decodes_as_colocated(consumer, colocated, "after-oversized", ids, prefill(producer, "p-oversized", ids), 6)
    settle(producer, consumer)
    assert_all_blocks_free(producer, consumer)


def test_a_stalled_producer_holds_up_only_its_own_pulls_which_are_then_recomputed(engines, monkeypatch):
    """Two pulls from a producer that never answers (a side channel that takes requests and says nothing) do not
    keep a third, from a live producer, waiting: it finishes while they still wait. They then time out and their
    prompts are computed here, with the colocated engine's answer."""
    import zmq

    producer, consumer, colocated = engines
    monkeypatch.setattr(mooncake, "SIDE_CHANNEL_TIMEOUT_S", 3.0)
    silent = zmq.Context.instance().socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        stalled = {}
        for i in range(mooncake.PULLS_PER_PEER):
            ids = prompt(80 + i, 2 * BLOCK)
            stalled[f"d-stalled-{i}"] = ids
            params = signed(dict(prefill(producer, f"p-stalled-{i}", ids), remote_port=port))
            submit(consumer, f"d-stalled-{i}", ids, max_tokens=6, kv_transfer_params=params)
        ids = prompt(85, 2 * BLOCK)
        submit(consumer, "d-live", ids, max_tokens=6, kv_transfer_params=prefill(producer, "p-live", ids))
        finished = {}
        while "d-live" not in finished:
            finished.update({o.request_id: o for o in consumer.step() if o.finished})
            producer.step()
        assert not set(stalled) & set(finished) and set(stalled) <= set(consumer.scheduler.loading)
        failures = consumer.kv_connector.stats.failures
        while not set(stalled) <= set(finished):
            finished.update({o.request_id: o for o in consumer.step() if o.finished})
            producer.step()
        assert consumer.kv_connector.stats.failures == failures + len(stalled)
        for request_id, ids in stalled.items():
            alone = run(colocated, f"c-{request_id}", ids, max_tokens=6)
            assert finished[request_id].outputs[0].token_ids == alone.outputs[0].token_ids
    finally:
        silent.close()
    settle(producer, consumer)  # (the stalled prefills were never claimed: freed after abort_timeout_s)
    assert_all_blocks_free(producer, consumer)


def test_abort_while_pulling_frees_the_blocks_once_the_pull_ends(engines):
    producer, consumer, _ = engines
    ids = prompt(50, 4 * BLOCK)
    params = prefill(producer, "p-abort", ids)
    gate = threading.Event()  # the producer's pull threads wait on it: the pull cannot end before the abort
    pool = consumer.kv_connector._pool_of(KVTransferParams.model_validate(params))
    for _ in range(mooncake.PULLS_PER_PEER):
        pool.submit(gate.wait)
    submit(consumer, "d-abort", ids, max_tokens=8, kv_transfer_params=params)
    consumer.step()  # admitted: blocks allocated, the pull queued
    assert "d-abort" in consumer.scheduler.loading
    held = len(consumer.kv.block_ids(consumer.scheduler.loading["d-abort"]))
    consumer.abort_request("d-abort")
    assert consumer.kv.num_blocks - consumer.kv.num_free_blocks == held  # kept: the pull will write them
    gate.set()
    settle(producer, consumer)
    assert consumer.kv_connector.stats.blocks > 0  # the pull ran, then its blocks were freed
    assert_all_blocks_free(producer, consumer)


def test_npu_engines_pull_the_kv_bit_for_bit_over_the_ascend_transport(fake_npu, monkeypatch, tiny_llama_dir,
                                                                       default_model_dir):
    """On the (fake) NPU: 128-token blocks in device memory, the transfer engine started with vllm-ascend's "ascend"
    protocol (this non-CUDA build of Mooncake serves it over TCP). The pulled blocks equal the producer's bit for
    bit, and the decode gives the colocated engine's tokens."""
    common = dict(model=str(tiny_llama_dir), tokenizer=str(default_model_dir), device="npu", dtype="bfloat16",
                  block_size=128, num_kv_blocks=8, max_model_len=512)
    producer = LLMEngine(EngineConfig(**common, kv_transfer_config=kv_config("kv_producer", "npu-prefill")))
    consumer = LLMEngine(EngineConfig(**common, kv_transfer_config=kv_config("kv_consumer", "npu-decode")))
    colocated = LLMEngine(EngineConfig(**common))
    try:
        assert producer.kv_connector.protocol == consumer.kv_connector.protocol == "ascend"
        # the pull threads bind to the KV cache's device (the NPU's current device is per thread)
        bound, set_device = [], torch.npu.set_device
        monkeypatch.setattr(torch.npu, "set_device", lambda device: (
            bound.append((threading.current_thread().name, str(device))), set_device(device)))
        ids = prompt(70, 2 * 128 + 44)
        params = prefill(producer, "p-npu", ids)
        consumer.kv_connector._pool_of(KVTransferParams.model_validate(params)).submit(lambda: None).result()
        assert [device for thread, device in bound if thread.startswith("npu-llm-kv-load")] == ["npu:0"]
        assert_decodes_as_colocated(consumer, colocated, "npu", ids, params, 8)
        local = consumer.kv_connector.stats
        assert local.pulls == 1 and local.blocks == 3
        # (freed blocks keep their bytes: compare them now; the consumer recomputed the prompt's last token only)
        remote_blocks = params["remote_block_ids"]
        local_blocks = [b for b in range(consumer.kv.num_blocks) if consumer.kv.blocks[b].block_hash is not None][:2]
        for (pk, pv), (ck, cv) in zip(producer.runner.kv_caches, consumer.runner.kv_caches):
            for remote, mine in zip(remote_blocks, local_blocks):
                assert torch.equal(pk[remote].cpu(), ck[mine].cpu()) and torch.equal(pv[remote].cpu(), cv[mine].cpu())
        settle(producer, consumer)
        assert_all_blocks_free(producer, consumer)
    finally:
        for engine in (producer, consumer, colocated):
            engine.shutdown()


@pytest.mark.parametrize("params, message", [
    ({"do_remote_prefill": True}, "need remote_engine_id, remote_request_id, remote_block_ids"),
    ({"do_remote_decode": True, "do_remote_prefill": True}, "exclude each other"),
    ({"do_remote_decode": True, "surprise": 1}, "surprise"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [-1],
      "remote_host": "h", "remote_port": 1}, "greater than or equal to 0"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [1],
      "remote_host": "h", "remote_port": 70000}, "remote_port"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [1],
      "remote_host": "h", "remote_port": 1, "remote_signature": "\u00e9" * 64}, "remote_signature"),
])
def test_malformed_kv_transfer_params_are_refused_where_they_enter(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(kv_transfer_params=params)


def test_kv_transfer_params_an_engine_cannot_act_on_are_refused_at_add(engines):
    producer, consumer, colocated = engines
    remote = {"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_block_ids": [0],
              "remote_host": "127.0.0.1", "remote_port": 1}
    cases = [
        (consumer, remote, {}, "not signed by a producer of this deployment"),
        (consumer, signed(remote, "another-deployments-key"), {}, "not signed by a producer of this deployment"),
        (colocated, {"do_remote_decode": True}, {}, "need an engine started with kv_transfer_config"),
        (consumer, {"do_remote_decode": True}, {}, "needs a kv_producer"),
        (producer, remote, {}, "needs a kv_consumer"),
        (producer, {"do_remote_decode": True}, {"n": 2}, "need n=1"),
        (consumer, signed(remote), {"prompt_logprobs": 1}, "prompt_logprobs"),
        (consumer, signed(dict(remote, remote_block_ids=[0, 1])), {}, "remote_block_ids has 2 blocks"),
        (consumer, signed(dict(remote, remote_tp_size=2)), {}, "tensor_parallel_size=2"),
    ]
    for engine, params, extra, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request("bad", {"prompt_token_ids": prompt(60, 10)},
                               SamplingParams(kv_transfer_params=params, **extra))
    assert_all_blocks_free(producer, consumer, colocated)


@pytest.mark.parametrize("config, message", [
    ({"kv_connector": "NixlConnector", "kv_role": "kv_producer"}, "unknown kv_connector 'NixlConnector'"),
    ({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_prefill"}, "unknown kv_role 'kv_prefill'"),
    ({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_both", "kv_prot": 1}, "kv_prot"),
    ({"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_both",
      "kv_connector_extra_config": {"abort_timeout_s": 0}}, "abort_timeout_s must be a positive number"),
])
def test_a_kv_transfer_config_it_cannot_serve_fails_the_load_naming_it(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(kv_transfer_config=config)
    with pytest.raises(ValueError, match="tensor_parallel_size=1"):
        EngineConfig(tensor_parallel_size=2, kv_transfer_config={"kv_connector": "MooncakeConnectorV1",
                                                                 "kv_role": "kv_both"})


def test_without_mooncake_the_start_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)  # (import fails as if it were not installed)
    with pytest.raises(RuntimeError, match="make install.*mooncake-transfer-engine-non-cuda.*libibverbs1"):
        start_transfer_engine("127.0.0.1", "cpu")


def test_kv_memory_is_registered_once_a_storage_and_within_hccls_region_limit():
    from backend.engine.kv_transfer.transfer_engine import MAX_ASCEND_REGIONS, memory_regions

    whole = torch.zeros(4, 8)
    assert memory_regions([whole[:2], whole[2:], whole], "ascend") == {whole.data_ptr(): whole.nbytes}
    layers = [torch.zeros(2, 8) for _ in range(MAX_ASCEND_REGIONS + 1)]
    assert len(memory_regions(layers, "tcp")) == MAX_ASCEND_REGIONS + 1  # (the limit is HCCL's)
    with pytest.raises(RuntimeError, match=f"257 separate device allocations, and HCCL registers at most 256"):
        memory_regions(layers, "ascend")
