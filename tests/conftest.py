"""Shared fixtures: tiny random-weight models of each architecture, and the default model."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from npu_llm_kernels.cpu_features import ENV, cpu_features, distinct_levels_up_to_host

# A stand-in for torch_npu (no Ascend hardware here): only tests put it on the path.
FAKE_TORCH_NPU = Path(__file__).parent / "fake_torch_npu"

# Every test here runs on the CPU with two cores.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


CPU_LEVELS = distinct_levels_up_to_host()


@contextlib.contextmanager
def at_cpu_level(level: str):
    """The CPU kernels at `level` (NPU_LLM_CPU_ISA, npu_llm_kernels/cpu_features.py) inside the block. Weights packed
    under one level are not for another."""
    before = os.environ.get(ENV)
    os.environ[ENV] = level
    cpu_features.cache_clear()
    try:
        yield level
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before
        cpu_features.cache_clear()


@pytest.fixture(params=CPU_LEVELS)
def cpu_level(request):
    """Each level this machine can run, lowest first: a machine with AMX runs the AVX2 paths too."""
    with at_cpu_level(request.param):
        yield request.param


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: skipped (and reported as skipped) where torch sees none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run tests/gpu_check.sh on a GPU machine)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)

@pytest.fixture
def fake_npu(monkeypatch):
    """torch_npu (the fake) importable and imported; everything undone afterwards."""
    monkeypatch.syspath_prepend(str(FAKE_TORCH_NPU))
    for key in ("PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE"):
        monkeypatch.delenv(key, raising=False)
    import torch_npu

    torch_npu.calls.clear()
    yield torch_npu
    import npu_llm_kernels

    npu_llm_kernels.__dict__.pop("npu", None)
    npu_llm_kernels.__dict__.pop("npu_mla", None)
    npu_llm_kernels.__dict__.pop("npu_quant", None)
    platform_modules = ["npu_llm_kernels.npu", "npu_llm_kernels.npu_mla", "npu_llm_kernels.npu_quant"]
    for name in [n for n in sys.modules if n.split(".")[0] == "torch_npu"] + platform_modules:
        sys.modules.pop(name, None)
    # The fake registered "npu" as torch's PrivateUse1 backend, which cannot be undone: torch.accelerator now asks
    # torch.npu whether one is available (compressed-tensors does, loading a checkpoint), so the answer stays: no.
    torch.npu = types.ModuleType("torch.npu")
    torch.npu.is_available, torch.npu.device_count = (lambda: False), (lambda: 0)
    for key in ("PYTORCH_NPU_ALLOC_CONF", "TASK_QUEUE_ENABLE"):
        os.environ.pop(key, None)


TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
)


# Tiny mixtures of experts: 8 experts, top-2, small experts; every layer sparse unless said otherwise.
TINY_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# Tiny latent attention (DeepSeek): a latent row of 32 + 16 values, heads of 24 + 16 for q . k and 20 for values
TINY_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=24, v_head_dim=20)


def _tiny_config(arch: str):
    from transformers import (
        DeepseekV2Config, DeepseekV3Config, Glm4Config, Glm4MoeConfig, GlmConfig, LlamaConfig, MistralConfig,
        MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig,
    )

    if arch == "llama":  # llama3 rope scaling and untied embeddings
        return LlamaConfig(
            **TINY,
            rope_theta=50000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 128,
            },
            tie_word_embeddings=False,
        )
    if arch == "qwen2":  # q/k/v biases, tied embeddings
        return Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=True)
    if arch == "mistral":
        return MistralConfig(**TINY, sliding_window=None, tie_word_embeddings=False)
    if arch == "qwen3":  # per-head q/k norm; head_dim (32) is not hidden_size / heads (16)
        return Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    if arch == "qwen3_moe":  # layer 1 of 3 dense (mlp_only_layers), renormalised top-k
        return Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 3}, **TINY_MOE, num_experts=8, norm_topk_prob=True,
                              mlp_only_layers=[1], tie_word_embeddings=False)
    if arch == "mixtral":
        return MixtralConfig(**{**TINY, "intermediate_size": 32}, num_local_experts=8, num_experts_per_tok=2,
                             sliding_window=None, tie_word_embeddings=False)
    if arch == "glm4_moe":  # sigmoid routing in 2 groups of 4, shared expert, first layer dense, partial rotary
        return Glm4MoeConfig(**{**TINY, "num_hidden_layers": 3}, **TINY_MOE, n_routed_experts=8, n_shared_experts=1,
                             n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
                             first_k_dense_replace=1, attention_bias=True, use_qk_norm=True,
                             tie_word_embeddings=False)
    if arch in ("glm", "glm4"):  # q/k/v biases, half of each head rotating in interleaved pairs (GLM-4-0414: and
        # the attention's and MLP's outputs normalised again); heads of 32 (16 rotating), gate and up stored as one
        config_class = GlmConfig if arch == "glm" else Glm4Config
        return config_class(**TINY, head_dim=32, attention_bias=True, pad_token_id=0, tie_word_embeddings=False)
    if arch == "deepseek_v2":  # V2-Lite's shape: no q low rank, greedy softmax routing, two shared experts
        return DeepseekV2Config(**{**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4}, **TINY_MOE,
                                **TINY_MLA, q_lora_rank=None, n_routed_experts=8, n_shared_experts=2,
                                topk_method="greedy", norm_topk_prob=False, first_k_dense_replace=1,
                                routed_scaling_factor=1.0, tie_word_embeddings=False)
    if arch == "deepseek_v3":  # q low rank, grouped sigmoid routing with a correction bias, YaRN
        return DeepseekV3Config(**{**TINY, "num_hidden_layers": 3, "num_key_value_heads": 4}, **TINY_MOE,
                                **TINY_MLA, q_lora_rank=48, n_routed_experts=8, n_shared_experts=1, n_group=2,
                                topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
                                rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                 "original_max_position_embeddings": 128, "beta_fast": 32,
                                                 "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
                                tie_word_embeddings=False)
    raise ValueError(arch)


def make_tiny_model(arch: str, path, vocab_size: int = TINY["vocab_size"], decisive_routing: bool = True,
                    **config_overrides):
    """A Hugging Face folder with random weights (biases made non-zero so they matter); a real tokenizer's
    `vocab_size` lets it take text. MoE models get experts that matter and, with decisive_routing, router logits
    far apart, so that a wrong choice of experts shows; without it, bf16 and fp32 seldom choose differently."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _tiny_config(arch)
    config.vocab_size = vocab_size
    for key, value in config_overrides.items():
        setattr(config, key, value)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif ".experts." in name or ".shared_experts." in name:
                p.mul_(8)  # at the init's scale the experts' share of the residual stream is a few percent
            elif name.endswith("mlp.gate.weight") and decisive_routing:
                p.mul_(30)  # decisive routing: a wrong choice of experts changes the output
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # steers the choice of experts: make it matter
                b.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


# Qwen2.5-VL's chat template (its chat_template.json), which writes a placeholder for each image part
QWEN_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tiny_qwen_vl(path, tokenizer_dir, arch: str = "qwen2_5_vl") -> Path:
    """A Qwen2.5-VL (arch "qwen3_vl": Qwen3-VL) folder with random weights, the way its checkpoints are published:
    config.json (text_config, vision_config), safetensors, preprocessor_config.json (its image processor, at a few
    hundred pixels an image so that images are a few dozen tokens) and a tokenizer with its special tokens and chat
    template (the default model's vocabulary). Qwen2.5-VL's tower: two blocks, windows of 2x2 merged patches, the
    second block over the whole image. Qwen3-VL's: three blocks, a 4x4 grid of learned positions, DeepStack from the
    first two; its decoder Qwen3's (q/k norms), its M-RoPE interleaved."""
    from transformers import (
        AutoModelForImageTextToText, AutoTokenizer, Qwen2_5_VLConfig, Qwen2VLImageProcessorPil, Qwen3VLConfig,
    )

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
                                                                "<|video_pad|>"]})
    tokenizer.chat_template = QWEN_VL_CHAT_TEMPLATE
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                                                          "<|image_pad|>", "<|video_pad|>")}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                rms_norm_eps=1e-6, eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|im_end|>"],
                rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2)
    if arch == "qwen3_vl":
        config_class = Qwen3VLConfig
        vision.update(depth=3, num_position_embeddings=16, deepstack_visual_indexes=[0, 1])
    else:
        config_class = Qwen2_5_VLConfig
        vision.update(window_size=56, fullatt_block_indexes=[1])
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                          video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                          vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_config(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(size={"shortest_edge": 28 * 28, "longest_edge": 28 * 28 * 16}, patch_size=14,
                             temporal_patch_size=2, merge_size=2).save_pretrained(path)
    return path


def random_image(width: int, height: int, seed: int):
    from PIL import Image

    pixels = torch.randint(0, 256, (height, width, 3), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.fixture(scope="session", params=["llama", "qwen2", "mistral"])
def tiny_model_dir(request, tmp_path_factory):
    return make_tiny_model(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"))


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir():
    from backend.models.registry import DEFAULT_MODEL, resolve_model

    return resolve_model(DEFAULT_MODEL)


def add_mtp_layer(model_dir, layer_scale: float = 0.01):
    """Give a tiny DeepSeek V3 / GLM-4.5 checkpoint the multi-token-prediction layer its config names
    (model.layers.{num_hidden_layers}: transformers neither makes nor reads it), built to draft like the target:
    its decoder layer is the last one's with the outputs of attention and experts zeroed, eh_proj passes the next
    token's embedding through, and its head is the model's: it drafts the token the embeddings alone predict. The
    target's layers have their outputs scaled by layer_scale (its experts, made 8x larger to matter, would drown the
    embeddings otherwise), so that at TINY's vocabulary its next token follows that prediction sometimes: drafts
    are both accepted and rejected, and attention and experts still decide most tokens."""
    from safetensors.torch import load_file, save_file

    config = json.loads((model_dir / "config.json").read_text())
    n, hidden = config["num_hidden_layers"], config["hidden_size"]
    path = model_dir / "model.safetensors"
    weights = load_file(path)
    for name in [k for k in weights if k.endswith(("o_proj.weight", "down_proj.weight"))]:
        weights[name] = weights[name] * layer_scale
    last = f"model.layers.{n - 1}."
    for name in [k for k in weights if k.startswith(last)]:
        tensor = weights[name].clone()
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensor.zero_()
        weights[f"model.layers.{n}." + name[len(last):]] = tensor
    mtp = f"model.layers.{n}."
    weights[mtp + "enorm.weight"] = torch.ones(hidden)
    weights[mtp + "hnorm.weight"] = torch.ones(hidden)
    weights[mtp + "eh_proj.weight"] = torch.cat((torch.eye(hidden), torch.zeros(hidden, hidden)), dim=1)
    weights[mtp + "shared_head.norm.weight"] = weights["model.norm.weight"].clone()
    weights[mtp + "shared_head.head.weight"] = weights["lm_head.weight"].clone()
    weights[mtp + "embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    save_file(weights, path, metadata={"format": "pt"})
    return model_dir


def rewrite_checkpoint(model_dir, tmp_path, change_tensors=None, change_config=None,
                       weights="model.safetensors", config="config.json"):
    """A copy of a one-file checkpoint ("bad", under tmp_path) with its tensors and its config.json (or another JSON
    file that describes it) changed in place by the given functions."""
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    if change_tensors:
        tensors = load_file(bad / weights)
        change_tensors(tensors)
        save_file(tensors, bad / weights, metadata={"format": "pt"})
    if change_config:
        described = json.loads((bad / config).read_text())
        change_config(described)
        (bad / config).write_text(json.dumps(described))
    return bad


def make_peft_adapter(base_dir, path, rank: int, targets: list[str], seed: int, use_rslora: bool = False):
    """A random PEFT LoRA adapter of `base_dir` saved at `path` (A and B both random, so that it matters), and the
    base model with it merged (PEFT's merge_and_unload, fp32): the reference for what serving it must give."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False,
                        use_rslora=use_rslora)
    model = get_peft_model(hf_model(base_dir), config)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def make_eagle_head(target_dir, path, method: str, aux_layers: list[int] | None = None, draft_vocab: int = 256):
    """A random-weight EAGLE ("eagle") or EAGLE-3 ("eagle3") head for the tiny model at target_dir, in the layout
    vLLM loads: EAGLE's fc and layers.0 (no input norm, the target's embedding and lm_head shared); EAGLE-3's fc over
    three target layers, midlayer (attention over 2 x hidden), norm, its own lm_head over a draft vocabulary of
    draft_vocab target ids (d2t: target id - draft id) and t2d."""
    from safetensors.torch import save_file

    target = json.loads((Path(target_dir) / "config.json").read_text())
    h, heads, kv_heads = target["hidden_size"], target["num_attention_heads"], target["num_key_value_heads"]
    head_dim, inter, vocab = target.get("head_dim") or h // heads, target["intermediate_size"], target["vocab_size"]
    g = torch.Generator().manual_seed(11)

    def w(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    prefix = "layers.0." if method == "eagle" else "midlayer."
    qkv_in = h if method == "eagle" else 2 * h
    tensors = {f"{prefix}self_attn.q_proj.weight": w(heads * head_dim, qkv_in),
               f"{prefix}self_attn.k_proj.weight": w(kv_heads * head_dim, qkv_in),
               f"{prefix}self_attn.v_proj.weight": w(kv_heads * head_dim, qkv_in),
               f"{prefix}self_attn.o_proj.weight": w(h, heads * head_dim),
               f"{prefix}post_attention_layernorm.weight": 1 + w(h),
               f"{prefix}mlp.gate_proj.weight": w(inter, h), f"{prefix}mlp.up_proj.weight": w(inter, h),
               f"{prefix}mlp.down_proj.weight": w(h, inter)}
    config = {"architectures": ["LlamaForCausalLMEagle" if method == "eagle" else "LlamaForCausalLMEagle3"],
              "model_type": "llama", "hidden_size": h, "intermediate_size": inter, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "vocab_size": vocab}
    if method == "eagle":
        tensors["fc.weight"] = w(h, 2 * h)
        tensors["embed_tokens.weight"] = w(vocab, h)  # (vLLM skips EAGLE's copy: the target's serves)
    else:
        ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        tensors.update({"fc.weight": w(h, 3 * h), f"{prefix}input_layernorm.weight": 1 + w(h),
                        f"{prefix}hidden_norm.weight": 1 + w(h), "norm.weight": 1 + w(h),
                        "lm_head.weight": w(draft_vocab, h), "d2t": ids - torch.arange(draft_vocab),
                        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)})
        config["draft_vocab_size"] = draft_vocab
        if aux_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path


def greedy_tokens(model, prompt: list[int], steps: int) -> list[int]:
    """A Hugging Face model's greedy continuation, never stopping early (as ignore_eos)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat((ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return ids[0, len(prompt):].tolist()


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A port free now and never handed out before in this run: the OS may offer a port again once its probe
    socket is closed, and a stack's five ports are taken before any server binds them."""
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


class TritonMetrics:
    """Triton's /metrics at a URL: a vLLM metric's value, now or once a condition holds."""

    def __init__(self, metrics_url: str):
        self.metrics_url = metrics_url

    def metric(self, name: str) -> float:
        """The value of an unlabelled-by-us vLLM metric line on Triton's /metrics (first match)."""
        import urllib.request

        text = urllib.request.urlopen(self.metrics_url, timeout=5).read().decode()
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(f"{name} not on /metrics")

    def wait_metric(self, name: str, predicate, timeout: float = 10.0) -> float:
        import time

        deadline = time.monotonic() + timeout
        while True:
            value = self.metric(name)
            if predicate(value) or time.monotonic() > deadline:
                return value
            time.sleep(0.1)

    def settled(self, timeout: float = 15.0) -> None:
        """Returns once nothing runs and every finished request is on /metrics. The backend publishes request
        records and gauges every REFRESH_S, so two equal readings a refresh apart, with nothing running, mean
        no record was still queued."""
        import time

        from backend.triton.metrics import REFRESH_S

        def reading():
            return (self.metric("vllm:num_requests_running"), self.metric("vllm:num_requests_waiting"),
                    self.metric("vllm:e2e_request_latency_seconds_count"))

        deadline, last = time.monotonic() + timeout, None
        while (now := reading()) != last or now[:2] != (0, 0):
            assert time.monotonic() < deadline, f"metrics did not settle: {now}"
            last = now
            time.sleep(REFRESH_S + 0.1)


class TritonUnderTest(TritonMetrics):
    def __init__(self, process, work_dir, log_path, http_port, grpc_port, metrics_port):
        self.process, self.work_dir, self.log_path = process, work_dir, log_path
        self.http_url = f"localhost:{http_port}"
        self.grpc_url = f"localhost:{grpc_port}"
        super().__init__(f"http://localhost:{metrics_port}/metrics")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


# For the engines tests start through the CLI: the CPU default (4 GiB) costs each process seconds of zeroing and
# 4 GB of RAM.
SMALL_KV_CACHE = "kv_cache_memory_gb=0.25"

# Engine arguments of the test server: fp32, so its greedy output can be compared token for token.
TRITON_ENGINE_ARGS = {"dtype": "float32", "num_kv_blocks": 512, "max_num_seqs": 16}


@pytest.fixture(scope="session")
def reference_llm():
    """The engine Triton serves (TRITON_ENGINE_ARGS), in this process, once: what served answers must equal."""
    from backend import LLM

    return LLM(**TRITON_ENGINE_ARGS)


@contextlib.contextmanager
def served_by_triton(engine_args: dict, log_path, lora_modules: dict[str, str] | None = None):
    """A real tritonserver serving model_repository (a run copy with engine_args, and lora_modules as `serve
    --lora-modules` adds them) for the block; stopped after."""
    import shutil

    from backend.entrypoints.serve import start_server, stop_process_group, wait_ready
    from backend.triton.launcher import DEFAULT_REPOSITORY

    ports = free_port(), free_port(), free_port()
    with open(log_path, "w") as log:
        process, work_dir = start_server(DEFAULT_REPOSITORY, engine_args, *ports, log_file=log, new_session=True,
                                         lora_modules=lora_modules)
    server = TritonUnderTest(process, work_dir, log_path, *ports)
    try:
        try:
            wait_ready(ports[0], process, timeout=300)
        except Exception:
            raise RuntimeError(f"tritonserver did not start:\n{server.log()[-5000:]}")
        yield server
    finally:
        stop_process_group(process, grace_s=20)
        shutil.rmtree(work_dir, ignore_errors=True)


def generate_through_triton(server: TritonUnderTest, body: dict) -> dict:
    """One request to the served model's HTTP generate endpoint; its JSON answer."""
    import urllib.request

    request = urllib.request.Request(f"http://{server.http_url}/v2/models/llm/generate", data=json.dumps(body).encode(),
                                     method="POST")
    return json.loads(urllib.request.urlopen(request, timeout=120).read())


@pytest.fixture(scope="session")
def triton_server(tmp_path_factory, default_model_dir):
    """A real tritonserver serving model_repository (a run copy with TRITON_ENGINE_ARGS and a profile_dir),
    once per session."""
    log_path = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    engine_args = {**TRITON_ENGINE_ARGS, "profile_dir": str(tmp_path_factory.mktemp("profiles"))}
    with served_by_triton(engine_args, log_path) as server:
        yield server


GATEWAY_API_KEY = "test-key"


def start_gateway(triton_grpc_url: str, port: int, log_path, api_key: str | None = GATEWAY_API_KEY,
                  extra_args: tuple = (), env_api_key: str | None = None, env: dict[str, str] | None = None):
    """`npu-llm gateway` as a real process; returns it once it answers HTTP (its model list, which answers without
    Triton too). env_api_key: the key given through NPU_LLM_API_KEY instead of --api-key; env: more variables."""
    import os
    import subprocess
    import sys

    from backend.entrypoints.serve import wait_http
    from backend.triton.launcher import LaunchError

    argv = [sys.executable, "-m", "backend.entrypoints.cli", "gateway", "--triton-url", triton_grpc_url, "--port", str(port),
            "--max-body-bytes", "200000", *extra_args]
    if api_key:
        argv += ["--api-key", api_key]
    env = {**{k: v for k, v in os.environ.items() if k != "NPU_LLM_API_KEY"}, **(env or {})}
    if env_api_key:
        env["NPU_LLM_API_KEY"] = env_api_key
    process = subprocess.Popen(argv, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=env)
    key = api_key or env_api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        wait_http(f"http://127.0.0.1:{port}/v1/models", process, "gateway", timeout=120, headers=headers)
    except LaunchError as e:
        process.kill()
        raise RuntimeError(f"{e}: {open(log_path).read()[-3000:]}") from e
    return process


@pytest.fixture(scope="session")
def gateway(triton_server, tmp_path_factory):
    port = free_port()
    process = start_gateway(triton_server.grpc_url, port, tmp_path_factory.mktemp("gateway") / "gateway.log")
    yield f"http://127.0.0.1:{port}"
    process.terminate()
    process.wait(15)
