"""`npu-llm verify`: does the device compute what the CPU computes?

The first check after installing a device stack (the Ascend ops guide starts there): fixed prompts
run through the model on the device, in the engine's kernels and dtype, and through
npu_llm_kernels/torch_ref.py on the CPU in float32, from the same weights. Compared:
- the hidden states after each group of layers, over every prompt token (cosine similarity, and
  the largest absolute error relative to the reference's largest value);
- the logits: of each prompt's last token, prefilled whole and again in two chunks (the chunked-
  prefill attention: splitfuse on the NPU), and of every decode step, where the device is fed the
  reference's greedy tokens (so one early difference does not decide every later step);
- top-1 agreement of those logits, and greedy agreement: how many of the device's own greedy
  tokens, generated freely, match the reference's before the first difference.
Each figure passes or fails against the tolerance of the device's dtype (TOLERANCES; docs/npu.md).

With --reference, the reference is another model: a quantized checkpoint against the unquantized model it was made
from (`npu-llm quantize`), on the same prompts; the tolerance is then the quantization scheme's
(QUANTIZED; docs/quantization.md). Without it a quantized model is held to QUANTIZED_AGAINST_ITSELF.
Of the engine flags, --model, --tokenizer, --device, --dtype, --block-size and --no-enforce-eager
(decode steps replayed from captured graphs) apply; one sequence runs at a time.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.config import EngineConfig
from backend.engine.runner import ModelRunner, SequenceChunk
from backend.engine.tokenizer import load_tokenizer
from backend.models.loader import load_config, load_model, max_model_len_of
from backend.models.registry import resolve_model
from backend.platform import resolve_platform
from npu_llm_kernels import ops_for, torch_ref
from npu_llm_kernels.metadata import cdiv

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Water boils at a temperature of",
    "Once upon a time, in a small village by the sea,",
]
LAYER_GROUPS = 4


@dataclass(frozen=True)
class Tolerance:
    cosine: float  # at least
    relative_error: float  # max |device - reference| / max |reference|, at most
    top1: float  # fraction of steps whose argmax agrees, at least
    # free-running greedy tokens equal to the reference's before the first difference, as a fraction of the
    # steps, averaged over the prompts, at least (near-ties legitimately part ways in half precision)
    greedy: float


# What rounding alone produces, measured as CPU bfloat16 / float16 against CPU float32 on the default
# model, with margin; a device outside them computes something else (docs/npu.md, "verify").
TOLERANCES = {
    torch.float32: Tolerance(cosine=0.99999, relative_error=1e-3, top1=1.0, greedy=1.0),
    torch.float16: Tolerance(cosine=0.999, relative_error=0.05, top1=0.9, greedy=0.5),
    torch.bfloat16: Tolerance(cosine=0.995, relative_error=0.15, top1=0.85, greedy=0.25),
}


# A quantized model on the device, in its dtype, against its unquantized source in fp32 (--reference): what W8A8
# dynamic costs the default model on the CPU in bf16, with margin (docs/quantization.md). Static W8A8 is held to the
# same: a static checkpoint that fails them loses more than dynamic quantization would.
_W8A8 = Tolerance(cosine=0.95, relative_error=0.5, top1=0.75, greedy=0.1)
# W8A16 quantizes nothing but the weights: measured on the default model in bf16 (per channel and per group of 64:
# logits cosine 0.9992 and 0.9995, top-1 0.95 and 0.97, greedy 0.60 and 0.69), with margin.
_W8A16 = Tolerance(cosine=0.99, relative_error=0.25, top1=0.9, greedy=0.2)
QUANTIZED = {"w8a8": _W8A8, "w8a16": _W8A16}  # by what the scheme quantizes (either format, any grouping)
# A quantized model against itself in fp32: a rounding difference moves an activation across a quantization step, so
# the dtype's tolerance is too tight; measured on the default model's W8A8 in bf16 on the CPU (logits cosine 0.993,
# largest error 0.15 of the largest logit, top-1 0.92, greedy 0.39), with margin.
QUANTIZED_AGAINST_ITSELF = Tolerance(cosine=0.985, relative_error=0.3, top1=0.85, greedy=0.25)


@dataclass
class Figure:
    name: str
    value: float
    limit: float
    at_least: bool  # the value must be >= limit (else <=)

    @property
    def passed(self) -> bool:
        return self.value >= self.limit if self.at_least else self.value <= self.limit

    def row(self, width: int) -> str:
        sign = ">=" if self.at_least else "<="
        return f"{self.name:<{width}}  {self.value:>10.6f}  {sign} {self.limit:<9g}  {'PASS' if self.passed else 'FAIL'}"


class _Side:
    """One model (device or reference) with its own KV cache, recording each layer's output."""

    def __init__(self, model, device: torch.device, block_size: int, max_len: int):
        self.model = model
        self.blocks_per_seq = cdiv(max_len, block_size)
        self.runner = ModelRunner(model, self.blocks_per_seq, block_size, device)
        self.layer_outputs: list[torch.Tensor] = []  # of the last prefill
        self.recording = False
        for layer in model.model.layers:  # a layer returns (its output, the residual stream): the sum is its hidden state
            layer.register_forward_hook(self._record)

    def _record(self, _module, _inputs, outputs) -> None:
        if self.recording:
            self.layer_outputs.append((outputs[0] + outputs[1]).float().cpu())

    def prefill(self, token_ids: list[int]) -> torch.Tensor:
        self.layer_outputs, self.recording = [], True
        try:
            return self._step(SequenceChunk(token_ids, 0, self._table()))
        finally:
            self.recording = False

    def prefill_in_two_chunks(self, token_ids: list[int]) -> torch.Tensor:
        half = len(token_ids) // 2
        self.runner.execute([SequenceChunk(token_ids[:half], 0, self._table(), wants_logits=False)])
        return self._step(SequenceChunk(token_ids[half:], half, self._table()))

    def decode(self, token_id: int, num_computed: int) -> torch.Tensor:
        return self._step(SequenceChunk([token_id], num_computed, self._table()))

    def _table(self) -> list[int]:
        return list(range(self.blocks_per_seq))

    def _step(self, chunk: SequenceChunk) -> torch.Tensor:
        return self.runner.execute([chunk]).logits[0].float().cpu()


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0).item()


def _relative_error(device: torch.Tensor, reference: torch.Tensor) -> float:
    return ((device - reference).abs().max() / reference.abs().max()).item()


def verify(config: EngineConfig, steps: int = 32, prompts: list[str] = PROMPTS,
           reference: str | None = None) -> tuple[str, list[Figure]]:
    """(a heading, the figures): the model on config.device in config.dtype against torch_ref in fp32, running the
    same model or the `reference` one."""
    if steps < 1:
        raise ValueError(f"steps={steps}: compare at least one decode step")
    if config.tensor_parallel_size > 1:
        raise ValueError("verify compares one device's kernels with the reference: run it without "
                         "tensor_parallel_size (the sharded model is checked against one rank by the tests)")
    platform = resolve_platform(config.device)
    model_dir = resolve_model(config.model)
    config.finalize(platform.name, max_model_len_of(load_config(model_dir)))
    tokenizer = load_tokenizer(config.tokenizer or model_dir)
    encoded = [tokenizer.encode(p) for p in prompts]
    max_len = max(map(len, encoded)) + steps
    model, _, _ = load_model(model_dir, ops_for(platform.name), platform.device, config.dtype, max_len,
                             quantization=config.quantization)
    reference_dir = resolve_model(reference) if reference else model_dir
    reference_model, reference_config, _ = load_model(reference_dir, torch_ref, "cpu", "float32", max_len,
                                                      quantization=None if reference else config.quantization)
    if reference_config.vocab_size != model.config.vocab_size:
        raise ValueError(f"--reference {reference_dir}: its vocabulary ({reference_config.vocab_size}) is not the "
                         f"model's ({model.config.vocab_size}); compare a quantized model with its own source")
    device = _Side(model, platform.device, config.block_size, max_len)
    cpu = _Side(reference_model, torch.device("cpu"), config.block_size, max_len)
    if not config.enforce_eager:  # the device's decode steps replay captured graphs
        device.runner.capture_decode_graphs(platform, 1, max_len)

    num_layers = len(model.model.layers)
    groups = [range(g * num_layers // LAYER_GROUPS, (g + 1) * num_layers // LAYER_GROUPS) for g in range(LAYER_GROUPS)]
    groups = [layers for layers in groups if layers]  # (a model of fewer layers than groups)
    hidden = {g: ([], []) for g in range(len(groups))}  # group -> (device states, reference states)
    logits, top1, greedy = ([], []), [], []

    def compare(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        logits[0].append(ours), logits[1].append(theirs)
        top1.append(int(ours.argmax()) == int(theirs.argmax()))

    for ids in encoded:
        ours, theirs = device.prefill(ids), cpu.prefill(ids)
        for g, layers in enumerate(groups):
            hidden[g][0].append(device.layer_outputs[layers[-1]])
            hidden[g][1].append(cpu.layer_outputs[layers[-1]])
        compare(device.prefill_in_two_chunks(ids), theirs)
        reference_tokens = []
        for step in range(steps):  # teacher-forced: both are fed the reference's greedy token
            compare(ours, theirs)
            reference_tokens.append(int(theirs.argmax()))
            if step + 1 < steps:
                ours = device.decode(reference_tokens[-1], len(ids) + step)
                theirs = cpu.decode(reference_tokens[-1], len(ids) + step)
        own, agreed = device.prefill(ids), 0
        for step in range(steps):  # free-running: the device follows its own greedy tokens
            token = int(own.argmax())
            if token != reference_tokens[step]:
                break
            agreed += 1
            if step + 1 < steps:
                own = device.decode(token, len(ids) + step)
        greedy.append(agreed / steps)

    schemes = [m.scheme for m in model.modules() if getattr(m, "scheme", None)]
    scheme = schemes[0] if schemes else None
    if scheme is None:
        tolerance = TOLERANCES[model.dtype]
    elif reference:  # (a model with W8A8 layers anywhere is held to W8A8's tolerance)
        tolerance = QUANTIZED["w8a16" if all(s.weight_only for s in schemes) else "w8a8"]
    else:
        tolerance = QUANTIZED_AGAINST_ITSELF
    figures = []
    for g, layers in enumerate(groups):
        ours, theirs = torch.cat(hidden[g][0]), torch.cat(hidden[g][1])
        name = f"layers {layers[0] + 1}-{layers[-1] + 1}"
        figures += [Figure(f"{name} cosine", _cosine(ours, theirs), tolerance.cosine, True),
                    Figure(f"{name} max abs error / max |ref|", _relative_error(ours, theirs),
                           tolerance.relative_error, False)]
    ours, theirs = torch.stack(logits[0]), torch.stack(logits[1])
    figures += [
        Figure("logits cosine", _cosine(ours, theirs), tolerance.cosine, True),
        Figure("logits max abs error / max |ref|", _relative_error(ours, theirs), tolerance.relative_error, False),
        Figure("logits top-1 agreement", sum(top1) / len(top1), tolerance.top1, True),
        Figure(f"greedy tokens agreed ({steps} steps)", sum(greedy) / len(greedy), tolerance.greedy, True),
    ]
    dtype = str(model.dtype).removeprefix("torch.")
    mode = "eager" if config.enforce_eager else "decode graphs"
    quantized = f", {scheme.name}" if scheme else ""
    against = reference_dir.name if reference else "npu_llm_kernels/torch_ref.py"
    heading = (f"{model_dir.name} on {platform.device} in {dtype}{quantized} ({mode}) against {against} on the CPU "
               f"in float32: {len(prompts)} prompts, {steps} steps")
    return heading, figures


def render(heading: str, figures: list[Figure]) -> str:
    width = max(len(f.name) for f in figures)
    lines = [heading, "", f"{'figure':<{width}}  {'value':>10}  limit         result"]
    lines += [f.row(width) for f in figures]
    failed = sum(not f.passed for f in figures)
    lines += ["", f"{failed} of {len(figures)} figures out of tolerance" if failed else "all figures within tolerance"]
    return "\n".join(lines)


def run_verify(args) -> int:
    config = EngineConfig.from_cli_args(args)
    heading, figures = verify(config, args.steps, reference=args.reference)
    print(render(heading, figures), flush=True)
    return 0 if all(f.passed for f in figures) else 1
