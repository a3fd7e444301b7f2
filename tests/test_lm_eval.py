"""lm-evaluation-harness (the PyPI package) against a real stack, as users validate a deployment: its
`local-completions` model through the gateway and Triton, and its own `hf` model on the same weights (fp32), on the
repository's local tasks (evals/tasks: multiple choice, perplexity, generation). The scores are equal, every
loglikelihood agrees to 1e-3 nats, and the greedy generations are the same text. Its `local-chat-completions` model
(generation only) with the chat template equals `hf` with the same template."""
from __future__ import annotations

import math

import pytest

from backend.models.registry import DEFAULT_MODEL
from tests.conftest import GATEWAY_API_KEY

pytestmark = pytest.mark.slow
TASKS = ["npu_llm_capitals", "npu_llm_paragraphs", "npu_llm_arithmetic"]
TOLERANCE = 1e-3  # nats, per loglikelihood (a sum over its tokens) in fp32


def _evaluate(model: str, model_args: str, tasks: list[str] = TASKS, **options) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, batch_size=1, log_samples=True, device="cpu",
                           task_manager=TaskManager(include_path="evals/tasks"), random_seed=0, **options)


def _loglikelihoods(results: dict, task: str) -> list[float]:
    values = []
    for sample in sorted(results["samples"][task], key=lambda s: s["doc_id"]):
        for response in sample["resps"]:
            first = response[0]
            values.append(float(first[0] if isinstance(first, (list, tuple)) else first))
    return values


def _generations(results: dict) -> list[str]:
    samples = sorted(results["samples"]["npu_llm_arithmetic"], key=lambda s: s["doc_id"])
    return [s["filtered_resps"][0] for s in samples if s["filter"] == "whole"]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OPENAI_API_KEY", GATEWAY_API_KEY)


def test_lm_eval_through_the_gateway_equals_lm_eval_on_transformers(gateway, default_model_dir, offline):
    served = _evaluate("local-completions", f"model={DEFAULT_MODEL},base_url={gateway}/v1/completions,"
                                           f"tokenizer={default_model_dir},max_length=512,max_retries=1")
    reference = _evaluate("hf", f"pretrained={default_model_dir},dtype=float32,max_length=512")
    for task in TASKS:
        ours, theirs = served["results"][task], reference["results"][task]
        for metric in ("acc,none", "exact_match,whole", "exact_match,last_number", "word_perplexity,none"):
            if metric in theirs:
                assert math.isclose(ours[metric], theirs[metric], rel_tol=1e-4), (task, metric, ours, theirs)
    assert served["results"]["npu_llm_capitals"]["acc,none"] > 0.25  # better than chance: the scores are real
    assert _generations(served) == _generations(reference) and any(_generations(served))  # greedy, the same stops
    for task in ("npu_llm_capitals", "npu_llm_paragraphs"):
        ours, theirs = _loglikelihoods(served, task), _loglikelihoods(reference, task)
        assert len(ours) == len(theirs) > 0
        worst = max(abs(a - b) for a, b in zip(ours, theirs))
        assert worst < TOLERANCE, (task, worst)


def test_lm_eval_chat_completions_equal_transformers_with_the_chat_template(gateway, default_model_dir, offline):
    served = _evaluate("local-chat-completions", f"model={DEFAULT_MODEL},base_url={gateway}/v1/chat/completions,"
                                                f"max_retries=1", ["npu_llm_arithmetic"], apply_chat_template=True)
    reference = _evaluate("hf", f"pretrained={default_model_dir},dtype=float32,max_length=512",
                          ["npu_llm_arithmetic"], apply_chat_template=True)
    ours, theirs = (r["results"]["npu_llm_arithmetic"] for r in (served, reference))
    assert ours["exact_match,whole"] == theirs["exact_match,whole"]
    assert ours["exact_match,last_number"] == theirs["exact_match,last_number"] > 0  # real answers, some right
    assert _generations(served) == _generations(reference) and any(_generations(served))
