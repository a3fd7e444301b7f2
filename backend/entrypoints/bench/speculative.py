"""`npu-llm bench spec`: output tokens/s with speculative decoding against plain decoding, on copy-heavy chat work
(repeat or lightly edit a passage the prompt holds: n-gram's best case, and where drafting pays in a chat UI), at
each batch size, greedy. Two engines in one process, the same model and prompts, runs interleaved so that the
machine's drift hits both. Each run's tokens/s counts its own tokens: in fp32 the outputs are the same, in bf16
a verification's attention (a short prefill chunk) rounds otherwise than a decode's and a near-tie can go the other
way, so the share of identical outputs is reported. One JSON line; only the ratios mean anything across machines.

With --deepen N the model drafts for a target built from it, N times as deep (deepened): each layer followed by N - 1
copies whose outputs are scaled down, so the target costs N times the draft model's compute and mostly agrees with
it, as a draft model distilled from its target does. No second checkpoint of the same vocabulary is needed."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from safetensors.torch import load_file, save_file

from backend.config import EngineConfig
from backend.engine.llm import LLM
from backend.engine.sampling_params import SamplingParams
from backend.models.registry import resolve_model

# n-gram's usual setting for copy work: drafts from suffixes of 2 to 4 tokens, 4 tokens at a time
DEFAULT_SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

PASSAGES = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, the members "
    "agreed to increase funding for the library by ten percent, to repair the roof of the community hall, and to "
    "hire two additional staff for the summer reading program.",
    "To reset the router, unplug it from the wall and wait thirty seconds. Plug it back in and wait until the "
    "status light turns solid green, which can take up to two minutes. If the light keeps blinking orange, hold the "
    "reset button on the back for ten seconds and set up the network again.",
    "The river rises in the northern hills and flows south through farmland for nearly two hundred miles before it "
    "reaches the sea. In spring the melting snow swells it, and the old stone bridge at the market town has been "
    "closed three times in the last decade because of flooding.",
    "Our return policy allows customers to return most items within thirty days of delivery for a full refund. "
    "Items must be unused and in their original packaging. Sale items, gift cards and personalised products cannot "
    "be returned, and shipping costs are refunded only when the item arrived damaged.",
]
TASKS = [
    "Copy the following passage word for word, without any changes:",
    "Repeat this text exactly as it is written:",
    "Rewrite the passage below, replacing the word \"the\" with \"a\" wherever it starts a sentence, and changing "
    "nothing else:",
    "Quote the following paragraph in full:",
]


def copy_conversations(n: int) -> list[list[dict]]:
    """n chat conversations, each asking to copy or lightly edit one of the passages."""
    return [[{"role": "user", "content": f"{TASKS[i % len(TASKS)]}\n\n{PASSAGES[i % len(PASSAGES)]}"}]
            for i in range(n)]


def deepened(model: str, out: Path, depth: int, scale: float = 0.05) -> Path:
    """A Llama model folder `depth` times as deep as `model`: after each layer, depth - 1 copies of it whose attention
    and MLP outputs (o_proj, down_proj) are scaled by `scale`, in one safetensors file. The tokenizer files come
    along (not the source's weights or their index). Per-layer lists some families' configs carry are not scaled."""
    source = resolve_model(model)
    config = json.loads((source / "config.json").read_text())
    layers = config["num_hidden_layers"]
    tensors = {}
    for path in sorted(source.glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    deep = {}
    for key, tensor in tensors.items():
        if not key.startswith("model.layers."):
            deep[key] = tensor
            continue
        index, rest = key.removeprefix("model.layers.").split(".", 1)
        for copy in range(depth):
            scaled = copy and rest.endswith(("o_proj.weight", "down_proj.weight"))
            deep[f"model.layers.{int(index) * depth + copy}.{rest}"] = tensor * scale if scaled else tensor.clone()
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in deep.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers * depth}))
    for name in source.iterdir():
        if name.is_file() and not name.name.startswith("model.safetensors") and name.name != "config.json":
            shutil.copy(name, out / name.name)
    return out


def _timed(llm: LLM, conversations, params) -> tuple[float, list[list[int]]]:
    llm.reset_prefix_cache()  # (each run computes its prompts)
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def run_spec_bench(args) -> dict:
    config = EngineConfig.from_cli_args(args)
    spec = config.speculative_config or DEFAULT_SPEC
    config.speculative_config = None
    if args.deepen > 1:  # the model drafts for a target built from it, deepen times as deep
        folder = Path(tempfile.mkdtemp(prefix="npu-llm-spec-bench-"))
        spec = {"model": config.model, "num_speculative_tokens": spec.get("num_speculative_tokens", 4)}
        config.model = str(deepened(config.model, folder / "target", args.deepen))
    try:
        return _run(config, spec, args)
    finally:
        if args.deepen > 1:
            shutil.rmtree(folder, ignore_errors=True)


def _run(config: EngineConfig, spec: dict, args) -> dict:
    plain = LLM(**config.to_dict())
    drafting = LLM(**{**config.to_dict(), "speculative_config": spec})
    params = SamplingParams(temperature=0, max_tokens=args.output_len)
    result = {"model": plain.engine.config.model, "deepen": args.deepen, "device": plain.engine.engine_info().device,
              "dtype": plain.engine.engine_info().dtype, "speculative_config": drafting.engine.config.speculative_config,
              "output_len": args.output_len, "batches": []}
    for batch in args.batch_sizes:
        conversations = copy_conversations(batch)
        _timed(plain, conversations[:1], params.model_copy(update={"max_tokens": 4}))  # warm-up
        _timed(drafting, conversations[:1], params.model_copy(update={"max_tokens": 4}))
        before = drafting.engine.stats().spec_decode
        plain_rates, spec_rates, identical = [], [], 0
        for _ in range(args.repeats):  # interleaved
            elapsed, expected = _timed(plain, conversations, params)
            plain_rates.append(sum(map(len, expected)) / elapsed)
            elapsed, drafted = _timed(drafting, conversations, params)
            spec_rates.append(sum(map(len, drafted)) / elapsed)
            identical += sum(a == b for a, b in zip(expected, drafted))
        after = drafting.engine.stats().spec_decode
        verifications = after.num_drafts - before.num_drafts
        accepted = after.num_accepted_tokens - before.num_accepted_tokens
        result["batches"].append({
            "batch_size": batch,
            "plain_output_tokens_per_s": [round(rate, 1) for rate in plain_rates],
            "spec_output_tokens_per_s": [round(rate, 1) for rate in spec_rates],
            "spec_vs_plain": round(sum(spec_rates) / sum(plain_rates), 3),
            "identical_outputs": round(identical / (batch * args.repeats), 3),
            "draft_acceptance_rate": round(accepted / max(1, after.num_draft_tokens - before.num_draft_tokens), 3),
            "mean_acceptance_length": round(1 + accepted / max(1, verifications), 2),
        })
    plain.shutdown()
    drafting.shutdown()
    print(json.dumps(result), flush=True)
    return result
