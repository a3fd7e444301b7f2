"""LLM: offline batch generation over an LLMEngine, modelled on vLLM's."""
from __future__ import annotations

from backend.config import EngineConfig
from backend.engine.engine import LLMEngine
from backend.engine.input_processor import PromptType
from backend.engine.lora_request import LoRARequest
from backend.engine.profiler import ProfileResult
from backend.engine.outputs import RequestOutput
from backend.engine.sampling_params import SamplingParams
from backend.engine.tokenizer import chat_prompt_ids


class RequestFailedError(RuntimeError):
    """A request of a generate() call failed in the engine; the others of the call were aborted."""


class LLM:
    """LLM(model=...).generate(prompts, SamplingParams(...))."""

    def __init__(self, model: str | None = None, **engine_args):
        if model is not None:
            engine_args["model"] = model
        self.engine = LLMEngine(EngineConfig(**engine_args))

    def shutdown(self) -> None:
        """Stop the engine: its tensor-parallel workers and their process group, its KV cache. Calling it again
        does nothing. An LLM that is garbage-collected, or still alive at interpreter exit, is shut down too."""
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def reset_prefix_cache(self) -> None:
        self.engine.kv.reset_prefix_cache()

    def start_profile(self) -> None:
        self.engine.start_profile()

    def stop_profile(self) -> ProfileResult:
        return self.engine.stop_profile()

    def generate(
        self, prompts: PromptType | list[PromptType], sampling_params: SamplingParams | list[SamplingParams] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in input order. A prompt is a string, a list of token ids or {"prompt_token_ids": [...]}; one
        adapter runs them all, or a list gives one per prompt (None: the base model)."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling_params for {len(prompts)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise ValueError(f"{len(loras)} lora_requests for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, sp, lora in zip(prompts, params, loras):
                ids.append(self.engine.add_request(None, prompt, sp, lora))
            return self._run(ids)
        except BaseException:
            for request_id in ids:  # leave the engine as it was: nothing of this call keeps running
                self.engine.abort_request(request_id, emit_output=False)
            raise

    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.engine.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return self.engine.list_loras()

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            for output in self.engine.step():
                if output.finished:
                    done[output.request_id] = output
            failures = self.engine.take_failures()
            failed = next((i for i in ids if i in failures), None)
            if failed is not None:
                raise RequestFailedError(f"request {failed} failed: {failures[failed]!r}") from failures[failed]
        return [done[i] for i in ids]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": chat_prompt_ids(self.engine.tokenizer, c)} for c in conversations]
        return self.generate(prompts, sampling_params, lora_request)
