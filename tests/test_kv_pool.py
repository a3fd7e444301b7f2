"""KV pools (backend/engine/kv_transfer/kv_pool.py): CPU offload brings an evicted prefix back from host memory, and a
Mooncake Store served by a real `mooncake_master` lets one engine load what another, in another process, computed.
Greedy outputs in fp32 are those of an engine without a pool; a pool that fails (a value of the wrong size, the
master killed) costs a recompute, never a request (unless kv_load_failure_policy is "fail"); every block returns."""
from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from backend.config import EngineConfig
from backend.engine.engine import LLMEngine
from backend.engine.kv_transfer.kv_pool import POOL_RETRY_S, PoolError
from backend.engine.request import Request
from backend.engine.sampling_params import SamplingParams
from backend.entrypoints.kv_pool_master import start_master
from backend.entrypoints.serve import stop_process_group
from tests.conftest import free_port
from tests.test_disaggregation import run

BLOCK = 16
COMMON = dict(dtype="float32", block_size=BLOCK, max_model_len=512)
STORE = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both"}


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 500) for _ in range(length)]


def probe(prompt_ids: list[int]) -> Request:
    """A request of these prompt ids, never queued: for its block hashes and keys."""
    return Request("probe", prompt_ids, SamplingParams(), 1, [])


def settle(engine: LLMEngine, timeout_s: float = 60) -> None:
    """Step an idle engine until its pool's saves have ended (their blocks are held until then; a save to a master
    that died ends when Mooncake's own calls give up)."""
    deadline = time.monotonic() + timeout_s
    while engine.scheduler.has_pending_transfers:
        if time.monotonic() > deadline:
            raise AssertionError(f"a KV transfer never ended: loading {list(engine.scheduler.loading)}, "
                                 f"sending {list(engine.scheduler.sending)}")
        engine.step()


def assert_blocks_back(engine: LLMEngine) -> None:
    settle(engine)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def computed_by(engine: LLMEngine, request_id: str, prompt_ids: list[int], **params):
    """(the request's output, the tokens the engine computed for it)."""
    before = engine.scheduler.num_computed_tokens
    output = run(engine, request_id, prompt_ids, **params)
    return output, engine.scheduler.num_computed_tokens - before


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, default_model_dir):
    engine = LLMEngine(EngineConfig(**COMMON, model=str(tiny_llama_dir), tokenizer=str(default_model_dir),
                                    num_kv_blocks=96))
    yield engine
    engine.shutdown()


def expected(reference: LLMEngine, request_id: str, prompt_ids: list[int]) -> list[int]:
    return run(reference, f"ref-{request_id}", prompt_ids, max_tokens=8).outputs[0].token_ids


# -- CPU offload ----------------------------------------------------------------------------------


def test_offload_brings_back_a_prefix_the_kv_cache_let_go(tiny_llama_dir, default_model_dir, reference):
    engine = LLMEngine(EngineConfig(**COMMON, model=str(tiny_llama_dir), tokenizer=str(default_model_dir),
                                    num_kv_blocks=24, kv_offloading_size=0.01, kv_offloading_backend="native"))
    try:
        first, other = prompt(1, 200), prompt(2, 320)  # (12 full blocks; then 20, which push the first out)
        run(engine, "first", first, max_tokens=8)
        run(engine, "other", other, max_tokens=8)
        again = first + [7, 8, 9]
        output, computed = computed_by(engine, "again", again, max_tokens=8)
        assert output.outputs[0].token_ids == expected(reference, "again", again)
        stats = engine.kv_connector.stats
        assert stats.pulls == 1 and stats.failures == 0
        local = output.metrics.num_cached_tokens
        assert local + stats.external_hits >= 12 * BLOCK and stats.external_hits >= BLOCK
        assert computed == len(again) - local - stats.blocks * BLOCK + 7  # the rest of the prompt, then 7 decodes
        assert stats.saved_blocks >= 12 + 20
        assert_blocks_back(engine)
    finally:
        engine.shutdown()


def test_a_request_loaded_from_host_memory_and_then_preempted_comes_back_the_same(tiny_llama_dir, default_model_dir,
                                                                                  reference):
    """A prompt whose head came from the pool, preempted while it decodes (the cache too small for both requests'
    replies, and it admitted last): it is admitted again, from what the caches still hold, with the same output."""
    engine = LLMEngine(EngineConfig(**COMMON, model=str(tiny_llama_dir), tokenizer=str(default_model_dir),
                                    num_kv_blocks=20, kv_offloading_size=0.01))
    try:
        first = prompt(14, 180)
        run(engine, "first", first, max_tokens=4)
        run(engine, "push", prompt(15, 300), max_tokens=4)  # (the first prompt's blocks leave the cache)
        again, other = first + [5], prompt(16, 90)
        for request_id, ids in (("other", other), ("again", again)):  # (the last admitted is the one preempted)
            engine.add_request(request_id, {"prompt_token_ids": ids},
                               SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
            engine.step()
        done = {}
        while len(done) < 2:
            done.update({o.request_id: o for o in engine.step() if o.finished})
            assert not engine.take_failures()
        assert engine.scheduler.num_preemptions > 0
        assert engine.kv_connector.stats.pulls >= 1
        # (each prompt counted once in the prefix-cache stats, however often it was admitted)
        assert engine.kv.prefix_queries == len(first) + 300 + len(again) + len(other)
        for request_id, ids in (("again", again), ("other", other)):
            reply = run(reference, f"ref-{request_id}", ids, max_tokens=100, ignore_eos=True).outputs[0].token_ids
            assert done[request_id].outputs[0].token_ids == reply
        assert_blocks_back(engine)
    finally:
        engine.shutdown()


# -- Mooncake Store -------------------------------------------------------------------------------

# One engine in another process: it loads what the test's engine saved (the values live in the segment the saving
# engine lends the store, so that engine stays up meanwhile), and prints its output, stats and computed tokens.
PEER = textwrap.dedent("""
    import json, sys
    from backend.config import EngineConfig
    from backend.engine.engine import LLMEngine
    from tests.test_disaggregation import run
    args = json.loads(sys.argv[1])
    engine = LLMEngine(EngineConfig(**args["config"]))
    before = engine.scheduler.num_computed_tokens
    output = run(engine, "peer", args["prompt"], max_tokens=8)
    stats = engine.kv_connector.stats
    print("PEER " + json.dumps({"tokens": output.outputs[0].token_ids, "hits": stats.external_hits,
                                "pulls": stats.pulls, "failures": stats.failures,
                                "computed": engine.scheduler.num_computed_tokens - before}), flush=True)
    engine.shutdown()
""")


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    """A mooncake_master of the test's own, and the Mooncake config its engines read (64 MiB lent each)."""
    rpc_port = free_port()
    master = start_master(rpc_port, free_port())
    saved = os.environ.get("MOONCAKE_CONFIG_PATH")
    try:
        config = tmp_path_factory.mktemp("mooncake") / "mooncake.json"
        config.write_text(json.dumps({"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE",
                                      "master_server_address": f"127.0.0.1:{rpc_port}", "protocol": "tcp",
                                      "global_segment_size": "64MB", "local_buffer_size": "16MB"}))
        os.environ["MOONCAKE_CONFIG_PATH"] = str(config)
        yield master
    finally:
        if saved is None:
            os.environ.pop("MOONCAKE_CONFIG_PATH", None)
        else:
            os.environ["MOONCAKE_CONFIG_PATH"] = saved
        stop_process_group(master)


def pooled_engine(model_dir, tokenizer_dir, **transfer) -> LLMEngine:
    return LLMEngine(EngineConfig(**COMMON, model=str(model_dir), tokenizer=str(tokenizer_dir), num_kv_blocks=64,
                                  kv_transfer_config={**STORE, **transfer}))


@pytest.fixture(scope="module")
def saver(master, tiny_llama_dir, default_model_dir):
    engine = pooled_engine(tiny_llama_dir, default_model_dir)
    yield engine
    engine.shutdown()


def test_an_engine_in_another_process_loads_the_prefix_another_computed(saver, reference, tiny_llama_dir,
                                                                       default_model_dir):
    long = prompt(3, 300)
    run(saver, "long", long, max_tokens=8)
    settle(saver)
    assert saver.kv_connector.stats.saved_blocks >= 300 // BLOCK
    follow_up = long + prompt(4, 40)
    config = dict(COMMON, model=str(tiny_llama_dir), tokenizer=str(default_model_dir), num_kv_blocks=64,
                  max_num_batched_tokens=32, kv_transfer_config=STORE)  # (the rest of the prompt in chunks of 32)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
    done = subprocess.run([sys.executable, "-c", PEER, json.dumps({"config": config, "prompt": follow_up})],
                          capture_output=True, text=True, env=env, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("PEER ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    peer = json.loads(lines[0][5:])
    assert peer["tokens"] == expected(reference, "follow-up", follow_up)
    assert peer["pulls"] == 1 and peer["failures"] == 0 and peer["hits"] == 300 // BLOCK * BLOCK
    assert peer["computed"] == len(follow_up) - peer["hits"] + 7
    assert_blocks_back(saver)


def fine_tuned(model_dir, into):
    """A copy of the model under the same folder name, one of its first layer's weights changed (same shapes, same
    config.json)."""
    from safetensors.torch import load_file, save_file

    copy = into / model_dir.name
    shutil.copytree(model_dir, copy)
    [weights] = sorted(copy.glob("*.safetensors"))
    tensors = load_file(str(weights))
    name = next(k for k in sorted(tensors) if ".layers.0." in k and k.endswith("proj.weight"))
    tensors[name] = tensors[name] + 1
    save_file(tensors, str(weights))
    return copy


def test_another_models_blocks_never_match(saver, master, tiny_llama_dir, default_model_dir, tmp_path):
    """Not even a fine-tune's of the same name and shapes: the keys carry a fingerprint of the weights."""
    shared = prompt(5, 100)
    run(saver, "shared", shared, max_tokens=4)
    settle(saver)
    other = pooled_engine(fine_tuned(tiny_llama_dir, tmp_path), default_model_dir)
    try:
        run(other, "shared", shared, max_tokens=4)
        assert other.kv_connector.stats.external_queries > 0 and other.kv_connector.stats.external_hits == 0
        assert other.kv_connector.key_prefix != saver.kv_connector.key_prefix
    finally:
        other.shutdown()


def test_blocks_staged_over_tcp_load_straight_into_the_kv_tensors_as_over_ascends_transport(
        saver, master, reference, tiny_llama_dir, default_model_dir, monkeypatch):
    """Over TCP a block is staged through one host buffer; over Ascend's transport it moves from and into the KV
    tensors' own slices (Mooncake's multi-buffer calls). Both make the same value: one path loads the other's."""
    from backend.engine.kv_transfer.mooncake_store import MooncakeBlockStore

    text = prompt(13, 130)
    run(saver, "staged", text, max_tokens=4)
    settle(saver)
    monkeypatch.setattr(MooncakeBlockStore, "STAGE_OVER_TCP", False)
    direct = pooled_engine(tiny_llama_dir, default_model_dir)
    try:
        assert not direct.kv_connector.store.staged
        output = run(direct, "direct", text + [3, 4], max_tokens=8)
        assert output.outputs[0].token_ids == expected(reference, "direct", text + [3, 4])
        assert direct.kv_connector.stats.pulls == 1 and direct.kv_connector.stats.blocks == 130 // BLOCK
        assert_blocks_back(direct)
    finally:
        direct.shutdown()


def truncate_first_block(engine: LLMEngine, prompt_ids: list[int]) -> None:
    """Replace the pool's value for the prompt's first block with a shorter one (a corrupt store)."""
    key = engine.kv_connector.pool_keys(probe(prompt_ids), 0, 1)[0]
    store = engine.kv_connector.store.store
    assert store.is_exist(key) == 1
    assert store.upsert(key, b"truncated") == 0 and store.get_size(key) == 9


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_a_value_of_the_wrong_size_is_recomputed_or_fails_by_the_policy(saver, master, reference, tiny_llama_dir,
                                                                      default_model_dir, policy, caplog):
    text = prompt(6 if policy == "recompute" else 7, 120)
    run(saver, f"{policy}-first", text, max_tokens=8)
    settle(saver)
    truncate_first_block(saver, text)
    loader = pooled_engine(tiny_llama_dir, default_model_dir, kv_load_failure_policy=policy)
    try:
        with caplog.at_level(logging.WARNING, logger="backend.engine.kv_transfer.kv_pool"):
            result = run(loader, f"{policy}-again", text, max_tokens=8)
        assert "did not load" in caplog.text and "holds 9 bytes, not" in caplog.text, loader.kv_connector.stats
        assert loader.kv_connector.stats.failures == 1
        if policy == "recompute":
            assert result.outputs[0].token_ids == expected(reference, f"{policy}-again", text)
        else:
            assert isinstance(result, Exception) and "did not load" in str(result)
        assert run(loader, "after", prompt(8, 40), max_tokens=4).finished  # (the engine goes on)
        assert_blocks_back(loader)
    finally:
        loader.shutdown()


def test_a_master_killed_mid_run_costs_a_recompute_not_a_request(tiny_llama_dir, default_model_dir, reference,
                                                                 tmp_path, monkeypatch, caplog):
    rpc_port = free_port()
    own = start_master(rpc_port, free_port())
    engine = None
    try:
        monkeypatch.setenv("MOONCAKE_MASTER", f"127.0.0.1:{rpc_port}")
        config = tmp_path / "mooncake.json"  # (the sizes; the master's address from MOONCAKE_MASTER)
        config.write_text(json.dumps({"global_segment_size": "64MB", "local_buffer_size": "16MB"}))
        monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
        engine = pooled_engine(tiny_llama_dir, default_model_dir)
        text = prompt(9, 150)
        run(engine, "before", text, max_tokens=4)
        settle(engine)
        stop_process_group(own)
        engine.kv.reset_prefix_cache()  # (so that the prompt is looked up in the pool again)
        with caplog.at_level(logging.WARNING, logger="backend.engine.kv_transfer.kv_pool"):
            output = run(engine, "after", text, max_tokens=8)
            assert output.outputs[0].token_ids == expected(reference, "after", text)
            assert run(engine, "next", prompt(10, 60), max_tokens=4).finished
        assert "lookup failed" in caplog.text and f"{POOL_RETRY_S:.0f} s" in caplog.text
        assert engine.kv_connector.stats.external_hits == 0 or engine.kv_connector.stats.failures >= 1
        assert_blocks_back(engine)
    finally:
        if engine is not None:
            engine.shutdown()
        stop_process_group(own)


# -- configuration --------------------------------------------------------------------------------


@pytest.mark.parametrize("values, why", [
    ({"kv_offloading_size": 1, "kv_offloading_backend": "lmcache"}, "only 'native'"),
    ({"kv_offloading_backend": "native"}, "needs kv_offloading_size"),
    ({"kv_offloading_size": 0}, "positive number of GiB"),
    ({"kv_offloading_size": 1, "kv_transfer_config": STORE}, "configure one of them"),
    ({"kv_offloading_size": 1, "tensor_parallel_size": 2}, "tensor_parallel_size=1"),
    ({"kv_transfer_config": {**STORE, "kv_load_failure_policy": "retry"}}, "kv_load_failure_policy"),
    ({"kv_transfer_config": {**STORE, "kv_connector_extra_config": {"lookup_timeout_s": 0}}}, "lookup_timeout_s"),
    ({"kv_transfer_config": {**STORE, "kv_connector": "LMCacheConnectorV1"}}, "unknown kv_connector"),
    ({"kv_transfer_config": {**STORE, "kv_connector": "OffloadingConnector"}}, "needs its size"),
])
def test_a_pool_configured_wrong_is_refused_naming_why(values, why):
    with pytest.raises(ValueError, match=why):
        EngineConfig(**values)


def test_offloading_is_vllms_offloading_connector_and_the_store_has_vllm_ascends_names():
    transfer = EngineConfig(kv_offloading_size=0.5, kv_offloading_backend="native").kv_transfer
    assert transfer.kv_connector == "OffloadingConnector" and transfer.is_pool
    assert transfer.kv_connector_extra_config == {"cpu_bytes_to_use": 1 << 29}
    for name in ("MooncakeStoreConnector", "AscendStoreConnector", "MooncakeConnectorStoreV1"):
        assert EngineConfig(kv_transfer_config={**STORE, "kv_connector": name}).kv_transfer.is_pool
    assert not EngineConfig(kv_transfer_config={"kv_connector": "MooncakeConnectorV1", "kv_role": "kv_both"}) \
        .kv_transfer.is_pool


def test_mooncake_settings_come_from_its_config_file_and_master_variable(tmp_path, monkeypatch):
    from backend.config import KVTransferConfig
    from backend.engine.kv_transfer.mooncake_store import mooncake_settings

    config = KVTransferConfig(**STORE, kv_ip="10.0.0.2")
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ValueError, match="needs the store's master: set MOONCAKE_MASTER"):
        mooncake_settings(config, "cpu")
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "10.0.0.1:50051", "global_segment_size": "3.125GB",
                                "local_buffer_size": 1 << 20}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    settings = mooncake_settings(config, "npu")
    assert settings["master_server_addr"] == "10.0.0.1:50051" and settings["local_hostname"] == "10.0.0.2"
    assert settings["global_segment_size"] == int(3.125 * (1 << 30)) and settings["local_buffer_size"] == 1 << 20
    assert settings["protocol"] == "ascend" and settings["metadata_server"] == "P2PHANDSHAKE"
    monkeypatch.setenv("MOONCAKE_MASTER", "10.0.0.9:6000")  # (over the file's)
    assert mooncake_settings(config, "cpu")["master_server_addr"] == "10.0.0.9:6000"
    path.write_text(json.dumps({"global_segment_size": "lots"}))
    with pytest.raises(ValueError, match="global_segment_size='lots' is not a size"):
        mooncake_settings(config, "cpu")


# -- Ascend NPU (the fake torch_npu) ----------------------------------------------------------------


def _cached_kv(engine: LLMEngine, prompt_ids: list[int]) -> list[torch.Tensor]:
    """Host copies of the KV, in every tensor, of the prompt's full blocks now in the device's prefix cache."""
    blocks = engine.kv.find_cached_prefix(probe(prompt_ids))
    return [t[blocks].to("cpu") for layer in engine.runner.kv_caches for t in layer]


def test_cpu_offload_on_the_npu_copies_blocks_back_on_a_thread_bound_to_the_kv_caches_device(
        fake_npu, monkeypatch, tiny_llama_dir, default_model_dir):
    bound = []
    set_device = torch.npu.set_device
    monkeypatch.setattr(torch.npu, "set_device", lambda device: (
        bound.append((threading.current_thread().name, str(device))), set_device(device)))
    engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), tokenizer=str(default_model_dir), device="npu",
                                    dtype="bfloat16", block_size=128, num_kv_blocks=4, max_model_len=512,
                                    kv_offloading_size=0.01))
    try:
        first = prompt(11, 300)  # (2 full blocks; the next prompt's 4 push them out)
        run(engine, "first", first, max_tokens=4)
        saved = _cached_kv(engine, first)
        assert saved[0].shape[0] == 2
        run(engine, "other", prompt(12, 400), max_tokens=4)
        assert engine.kv.find_cached_prefix(probe(first)) == []
        run(engine, "again", first, max_tokens=4)
        stats = engine.kv_connector.stats
        assert stats.pulls == 1 and stats.blocks == 2 and stats.failures == 0
        assert all(torch.equal(a, b) for a, b in zip(saved, _cached_kv(engine, first)))  # the same bytes came back
        assert [device for name, device in bound if name.startswith("kv-pool")] == ["npu:0"]
        assert_blocks_back(engine)
    finally:
        engine.shutdown()


# -- the host pool and the keys -------------------------------------------------------------------


def test_the_host_pool_evicts_a_prompts_tail_before_its_head_and_never_what_a_load_waits_for():
    from backend.config import KVTransferConfig
    from backend.engine.kv_transfer.host_pool import HostBlockStore

    store = HostBlockStore(KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            kv_connector_extra_config={"num_cpu_blocks": 3}))
    kv = [torch.arange(8 * 4, dtype=torch.float32).reshape(8, 4) + 100 * i for i in range(2)]
    store.register(kv)
    assert store.put(["a0", "a1", "a2"], [0, 1, 2]) == 3
    assert store.put(["b0"], [3]) == 1
    assert store.contains(["a0", "a1", "a2", "b0"]) == [True, True, False, True]  # (a's tail went first)
    store.pin(["a1"])  # (a load of it is on its way)
    assert store.put(["c0", "c1"], [4, 5]) == 2
    assert store.contains(["a0", "a1", "b0", "c0", "c1"]) == [False, True, False, True, True]
    assert store.put(["d0", "d1", "d2"], [6, 7, 0]) == 2  # (one slot stays pinned: fewer saved)
    store.pin(["d0", "d1"])
    assert store.put(["e0"], [2]) == 0 and store.contains(["d0", "d1", "e0"]) == [True, True, False]  # (all pinned)
    store.unpin(["d0", "d1"])
    store.get(["a1"], [7])  # (the bytes of block 1 into block 7)
    store.unpin(["a1"])
    assert all(torch.equal(t[7], t[1]) for t in kv)
    with pytest.raises(PoolError, match="left host memory"):
        store.get(["c0"], [0])


def test_a_models_key_follows_its_files_not_its_path(tmp_path, tiny_llama_dir):
    from backend.engine.kv_transfer.kv_pool import model_key

    copy = tmp_path / "elsewhere" / tiny_llama_dir.name
    shutil.copytree(tiny_llama_dir, copy)
    key = model_key("tiny", tiny_llama_dir, None)
    assert key.startswith("tiny-") and model_key("tiny", copy, None) == key != model_key("tiny", copy, "ascend")
    assert model_key("tiny", fine_tuned(tiny_llama_dir, tmp_path), None) != key
