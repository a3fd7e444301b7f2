"""TritonPythonModel: the engine behind Triton's python backend, decoupled and streaming.

Threads: Triton calls execute() and gets control back at once; each request becomes a
coroutine on our asyncio loop (its own thread), reading an AsyncEngine stream (the engine
steps on a third thread). Responses go out through a sender thread, since a send may block
on IPC; that thread also notices cancelled requests, which the coroutine then aborts.

If the engine dies, the model unloads itself (as vllm_backend's health check does, with
ENABLE_VLLM_HEALTH_CHECK, on by default here), so Triton's model readiness turns false; that
needs --model-control-mode=explicit, which `npu-llm serve` uses. Under any mode, requests from
then on get UNAVAILABLE at once.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import gc
import itertools
import json
import os
import queue
import threading
import time
import traceback

import numpy as np
import triton_python_backend_utils as pb_utils

from backend.config.control_key import control_key
from backend.engine.async_engine import AsyncEngine, EngineDeadError
from backend.triton.contract import (
    ENGINE_UNAVAILABLE,
    INPUTS,
    INVALID_REQUEST,
    LORA_ACTIONS,
    OUTPUTS,
    ParsedRequest,
    admin_action,
    parse_request,
    request_parameters,
    response_tensors,
)
from backend.triton.instances import engine_config, instance_place
from backend.triton.loras import LoRARefused, LoRARepository
from backend.triton.metrics import InterTokenTimes, RequestRecord, VllmMetrics
from backend.triton.model_json import parse_model_json

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
UNSUPPORTED_LORA = "[Error] Unsupported LoRA."  # the text_output of vllm_backend's refusal of a lora_name
# finalize() waits this long, all requests together, for in-flight requests to send their last response.
FINALIZE_WAIT_S = 5.0
# A request is asked about at most this often whether its client cancelled it: each ask is a round trip to the Triton
# process, and asking after every streamed token cost throughput where the serving path was the bound
# (docs/performance.md). A cancelled request still stops within about this long and two steps (the ask follows a send).
CANCELLED_CHECK_S = 0.2


def _bool_parameter(parameters: dict, key: str, default: bool) -> bool:
    """A config.pbtxt parameter holding "true" or "false"."""
    value = parameters.get(key, {}).get("string_value")
    return default if value is None else value.strip().lower() == "true"


def _drain(items):
    """A function taking everything queued in a deque so far (appended on another thread)."""
    def take() -> list:
        return [items.popleft() for _ in range(len(items))]
    return take


class _Sender:
    """One request's response sender plus what the sender thread learned about it."""

    def __init__(self, sender):
        self.sender = sender
        self.cancelled = False
        self._asked_at = time.monotonic()

    def ask_cancelled(self) -> bool:
        """Whether the client cancelled the request, asked of Triton at most every CANCELLED_CHECK_S (by the sender
        thread for a stream, by the request's coroutine otherwise: one asker a request)."""
        now = time.monotonic()
        if not self.cancelled and now - self._asked_at >= CANCELLED_CHECK_S:
            self.cancelled = self.sender.is_cancelled()
            self._asked_at = now
        return self.cancelled


class TritonPythonModel:
    @staticmethod
    def auto_complete_config(auto_complete_model_config):
        """The contract's inputs and outputs (backend/triton/contract.py), for those config.pbtxt leaves out."""
        config = auto_complete_model_config.as_dict()
        have = {t["name"] for t in config.get("input", [])} | {t["name"] for t in config.get("output", [])}
        for spec in INPUTS:
            if spec["name"] not in have:
                auto_complete_model_config.add_input(spec)
        for spec in OUTPUTS:
            if spec["name"] not in have:
                auto_complete_model_config.add_output(spec)
        auto_complete_model_config.set_max_batch_size(0)
        auto_complete_model_config.set_model_transaction_policy({"decoupled": True})
        return auto_complete_model_config

    def initialize(self, args):
        self.logger = pb_utils.Logger
        self.model_config = json.loads(args["model_config"])
        model_dir = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(model_dir, "model.json")) as f:
            model_json = parse_model_json(json.load(f))  # vLLM's key names work; what can't be honoured fails, named
        self._model_name = args["model_name"]
        index, count = instance_place(args["model_instance_name"], self._model_name,
                                      self.model_config.get("instance_group", []))
        if count != model_json.data_parallel_size:
            raise ValueError(f"model.json's data_parallel_size is {model_json.data_parallel_size} but config.pbtxt's "
                             f"instance_group has {count} instance(s): one engine per instance, so make them equal "
                             "(`npu-llm serve` writes the count from data_parallel_size)")
        config = self._engine_config(model_json.config, index, count)
        self.loras = LoRARepository.for_model(config.enable_lora, model_dir)  # (before the engine: a missing file)
        params = self.model_config.get("parameters", {})
        # vllm_backend's switch; on by default here, since a dead engine should never look ready
        self._health_check = _bool_parameter(params, "ENABLE_VLLM_HEALTH_CHECK", default=True)
        self.engine = AsyncEngine.from_config(config, on_dead=self._engine_died)
        self.logger.log_info(f"[npu-llm] engine {index} of {count} ready: {config.model} on "
                             f"{self.engine.info.device} ({model_json.layout})")

        self.metrics = None
        if _bool_parameter(params, "REPORT_CUSTOM_METRICS", default=False) and not model_json.disable_log_stats:
            # vllm_backend's labels; with data parallel, vLLM's engine label too: which engine a series is from
            labels = {"model": args["model_name"], "version": args["model_version"]}
            if count > 1:
                labels["engine"] = str(index)
            engine_info = self.engine.info
            info = {"engine_model": config.model, "device": engine_info.device, "layout": model_json.layout}
            cache_info = {"block_size": str(config.block_size), "num_gpu_blocks": str(engine_info.num_kv_blocks),
                          "enable_prefix_caching": str(config.enable_prefix_caching),
                          "cache_dtype": engine_info.dtype,
                          "gpu_memory_utilization": str(config.gpu_memory_utilization)}
            self.metrics = VllmMetrics(pb_utils, labels, self.engine.stats, info, config.max_model_len, cache_info,
                                       _drain(self.engine.iteration_tokens))

        self._ids = itertools.count()
        self._inflight: set[asyncio.Future] = set()
        self._accepting = True
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="npu-llm-requests", daemon=True)
        self._loop_thread.start()
        self._responses: queue.SimpleQueue = queue.SimpleQueue()
        self._sender_thread = threading.Thread(target=self._send_loop, name="npu-llm-sender", daemon=True)
        self._sender_thread.start()
        self._lora_updates = asyncio.Lock()  # one run-time load or unload at a time (on the requests' loop)
        try:  # every adapter of multi_lora.json read and checked now: a bad one fails the load, named
            for lora in self.loras.adapters.values():
                asyncio.run_coroutine_threadsafe(self.engine.add_lora(lora), self._loop).result()
        except BaseException:
            self.engine.shutdown()
            raise

    @staticmethod
    def _engine_config(config, index: int, count: int):
        """Engine `index` of `count`: on its own devices (backend/triton/instances.py); on the CPU, the engines
        share the cores' threads."""
        import torch

        from backend.platform import device_type

        kind = device_type(config.device)  # (not opening the first device: engine k > 0 never touches it)
        if kind == "cpu" and count > 1:
            torch.set_num_threads(max(1, torch.get_num_threads() // count))
        return engine_config(config, index, kind)

    # -- requests ---------------------------------------------------------------------------------

    def execute(self, requests):
        for request in requests:
            if not self._accepting or not self.engine.is_running:
                why = f"the engine stopped: {self.engine.dead_error!r}" if self._accepting else "shutting down"
                self._send_error(_Sender(request.get_response_sender()), f"{ENGINE_UNAVAILABLE}{why}",
                                 pb_utils.TritonError.UNAVAILABLE)
                continue
            future = asyncio.run_coroutine_threadsafe(self._serve(request), self._loop)
            self._inflight.add(future)
            future.add_done_callback(self._inflight.discard)
        return None

    async def _serve(self, request) -> None:
        """One request, from parsing to its final response: whatever happens, it gets one."""
        sender = _Sender(request.get_response_sender())
        try:
            await self._serve_request(request, sender)
        except Exception as e:
            self.logger.log_error(f"[npu-llm] request failed: {traceback.format_exc()}")
            self._send_error(sender, f"request failed: {e!r}", pb_utils.TritonError.INTERNAL)

    async def _serve_request(self, request, sender: _Sender) -> None:
        try:
            parameters = request_parameters(request.parameters())
            action = admin_action(parameters, control_key())
        except ValueError as e:  # (AdminRefused too: its message names what is missing)
            self._send_error(sender, f"{INVALID_REQUEST}{e}", pb_utils.TritonError.INVALID_ARG)
            return
        if action is not None:
            await self._admin(action, parameters, sender)
            return
        try:
            inputs = {}
            for spec in INPUTS:
                tensor = pb_utils.get_input_tensor_by_name(request, spec["name"])
                inputs[spec["name"]] = None if tensor is None else tensor.as_numpy()
            # (images are decoded on a thread: this loop streams every other request meanwhile)
            parsed = parse_request(inputs, parameters) if inputs.get("image") is None else \
                await asyncio.to_thread(parse_request, inputs, parameters)
            lora = self.loras.resolve(parsed.lora_name)
        except LoRARefused as e:  # (vllm_backend's texts, as its response carries them)
            self._send_error(sender, str(e), pb_utils.TritonError.INVALID_ARG, UNSUPPORTED_LORA)
            return
        except ValueError as e:
            self._send_error(sender, f"{INVALID_REQUEST}{e}", pb_utils.TritonError.INVALID_ARG)
            return
        request_id = f"triton-{next(self._ids)}"
        try:
            await self._generate(parsed, lora, request_id, sender)
        except ValueError as e:  # rejected by the engine (prompt too long, ...)
            self._send_error(sender, f"{INVALID_REQUEST}{e}", pb_utils.TritonError.INVALID_ARG)
        except EngineDeadError as e:
            self._send_error(sender, f"{ENGINE_UNAVAILABLE}{e}", pb_utils.TritonError.UNAVAILABLE)
        except Exception as e:
            self.logger.log_error(f"[npu-llm] request {request_id} failed: {traceback.format_exc()}")
            self._send_error(sender, f"generation failed: {e}", pb_utils.TritonError.INTERNAL)

    async def _generate(self, parsed: ParsedRequest, lora, request_id: str, sender: _Sender) -> None:
        sent_tokens = [0] * parsed.params.n
        output = None
        gaps = InterTokenTimes()
        async for output in self.engine.generate(parsed.engine_prompt, parsed.params, request_id, lora):
            gaps.update(output)
            if sender.cancelled or (not parsed.stream and sender.ask_cancelled()):
                self.logger.log_info(f"[npu-llm] request {request_id} cancelled")
                self.engine.abort(request_id)
                self._record(output, parsed, gaps, cancelled=True)
                self._send_error(sender, "Request was cancelled", pb_utils.TritonError.CANCELLED)
                return
            if parsed.stream:
                self._queue_response(sender, response_tensors(parsed, output, sent_tokens), output.finished)
        if not parsed.stream:
            self._queue_response(sender, response_tensors(parsed, output, sent_tokens), True)
        self._record(output, parsed, gaps)

    async def _admin(self, action: str, parameters: dict, sender: _Sender) -> None:
        """start_profile / stop_profile / engine_info / load_lora_adapter / unload_lora_adapter; the answer is one
        JSON text_output."""
        try:
            if action == "engine_info":
                result = {"max_model_len": self.engine.config.max_model_len, "enable_lora": self.loras.enabled,
                          "lora_adapters": self.loras.listing()}
            elif action in LORA_ACTIONS:
                result = await self._update_loras(action, str(parameters.get("lora_name", "")),
                                                  str(parameters.get("lora_path", "")))
            elif action == "start_profile":
                await self.engine.start_profile()
                result = {"profiling": True}
            else:
                profile = await self.engine.stop_profile()
                result = {"profiling": False, **profile.to_dict(), "table": profile.table()}
        except LookupError as e:  # an adapter that is not there
            self._send_error(sender, f"{INVALID_REQUEST}{e}", pb_utils.TritonError.NOT_FOUND)
            return
        except (ValueError, RuntimeError) as e:  # profiling off, a bad adapter, not in the state the action needs
            self._send_error(sender, f"{INVALID_REQUEST}{e}", pb_utils.TritonError.INVALID_ARG)
            return
        if action != "engine_info":  # (a lookup, not worth a line)
            self.logger.log_info(f"[npu-llm] {action} done")
        self._queue_response(sender, {"text_output": np.array([json.dumps(result).encode()], dtype=np.object_)}, True)

    async def _update_loras(self, action: str, name: str, path: str) -> dict:
        """load_lora_adapter (read and checked before anyone can name it) or unload_lora_adapter."""
        async with self._lora_updates:
            if action == "load_lora_adapter":
                lora = self.loras.new(name, path)
                await self.engine.add_lora(lora)
                self.loras.add(lora)
                return {"loaded": name}
            lora = self.loras.remove(name)
            await self.engine.remove_lora(lora.lora_int_id)
            return {"unloaded": name}

    def _record(self, output, parsed: ParsedRequest, gaps: InterTokenTimes, cancelled: bool = False) -> None:
        """The request's figures for vLLM's per-request metrics (phases as vLLM splits them)."""
        if self.metrics is None or output is None:
            return
        m = output.metrics
        end = m.finish_time or time.time()
        generated = sum(len(c.token_ids) for c in output.outputs)

        def span(start, stop):
            return stop - start if start and stop else None

        prompt_len = len(output.prompt_token_ids)
        self.metrics.record(RequestRecord(
            prompt_tokens=prompt_len, generation_tokens=generated,
            ttft_s=span(m.arrival_time, m.first_token_time), e2e_s=end - m.arrival_time, n=parsed.params.n,
            max_tokens=output.max_tokens,
            finish_reasons=tuple((c.finish_reason or "abort") if cancelled else str(c.finish_reason)
                                 for c in output.outputs),
            queue_s=span(m.arrival_time, m.scheduled_time), prefill_s=span(m.scheduled_time, m.first_token_time),
            decode_s=span(m.first_token_time, end), inference_s=span(m.scheduled_time, end),
            inter_token_s=gaps.intervals,
        ))

    # -- responses --------------------------------------------------------------------------------

    def _queue_response(self, sender: _Sender, tensors: dict[str, np.ndarray], final: bool) -> None:
        response = pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(k, v) for k, v in tensors.items()])
        self._responses.put((sender, response, FINAL if final else 0))

    def _send_error(self, sender: _Sender, message: str, code, text_output: str | None = None) -> None:
        """An error response (with a text_output too where vllm_backend's carries one)."""
        tensors = [] if text_output is None else [
            pb_utils.Tensor("text_output", np.array([text_output.encode()], dtype=np.object_))]
        response = pb_utils.InferenceResponse(output_tensors=tensors, error=pb_utils.TritonError(message, code))
        self._responses.put((sender, response, FINAL))

    def _send_loop(self) -> None:
        while True:
            item = self._responses.get()
            if item is None:
                return
            sender, response, flags = item
            try:
                sender.sender.send(response, flags)
                if not flags & FINAL:
                    sender.ask_cancelled()
            except Exception:
                self.logger.log_error(f"[npu-llm] sending a response failed: {traceback.format_exc()}")

    # -- health and shutdown ----------------------------------------------------------------------

    def _engine_died(self, error: BaseException) -> None:
        """On the engine's thread, once: take the model out of service, so readiness says what happened."""
        self.logger.log_error(f"[npu-llm] the engine stopped: {error!r}")
        if not self._health_check:
            return  # ENABLE_VLLM_HEALTH_CHECK false: requests get UNAVAILABLE, readiness is left alone
        self.logger.log_error(f"[npu-llm] unloading model {self._model_name}")
        try:
            pb_utils.unload_model(self._model_name)  # non-blocking; needs --model-control-mode=explicit
        except Exception as e:
            self.logger.log_warn(f"[npu-llm] could not unload the model ({e}); its requests fail as UNAVAILABLE")

    def finalize(self):
        self.logger.log_info("[npu-llm] finalize: aborting in-flight requests")
        self._accepting = False
        self.engine.shutdown()  # in-flight streams end with finish_reason "abort"
        # one deadline for all of them: a busy server must still exit promptly on SIGTERM
        concurrent.futures.wait(list(self._inflight), timeout=FINALIZE_WAIT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(5)
        self._responses.put(None)
        self._sender_thread.join(5)
        if self.metrics is not None:
            self.metrics.close()
        platform = self.engine.info.platform
        del self.engine
        gc.collect()
        if platform == "cuda":
            import torch

            torch.cuda.empty_cache()
