"""Short real loads (4 users, a few seconds) with locust against the real stack, one per target, and their reports."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import GATEWAY_API_KEY

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("target", ["gateway", "triton-grpc", "triton-http"])
def test_short_load_reports_consistent_figures(target, triton_server, gateway, tmp_path):
    host = {"gateway": gateway, "triton-grpc": triton_server.grpc_url,
            "triton-http": f"http://{triton_server.http_url}"}[target]
    triton_server.settled()
    before = triton_server.metric("vllm:generation_tokens_total")
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "backend.entrypoints.cli", "loadtest", "--target", target, "--host", host, "--users", "4",
         "--spawn-rate", "4", "--run-time", "6s", "--out", str(out), "--prompt-len", "32:96", "--max-tokens",
         "8:24", "--api-key", GATEWAY_API_KEY],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())["summary"]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    assert summary["errors"] == 0 and summary["requests"] == len(records) >= 4
    for metric in ("TTFT", "ITL", "TPOT", "E2E"):
        stats = summary["latency_ms"][metric]
        assert stats["count"] > 0 and all(stats[k] is not None for k in ("mean", "p50", "p90", "p99")), metric
    # (the arithmetic from chunk times to these figures: tests/test_loadtest_report.py)
    assert summary["latency_ms"]["TTFT"]["count"] == len(records)
    assert summary["latency_ms"]["ITL"]["count"] == sum(len(r["chunk_times"]) - 1 for r in records)
    for r in records:
        assert 8 <= r["output_tokens"] <= 24  # EOS ignored: exactly what was asked for
    after = triton_server.wait_metric("vllm:generation_tokens_total",
                                      lambda v: v - before >= summary["output_tokens"], timeout=10)
    assert after - before == summary["output_tokens"] == sum(r["output_tokens"] for r in records)
    assert summary["output_tokens_per_s"] > 0
    for name in ("ttft_hist.png", "itl_hist.png", "throughput.png", "report.html", "summary.csv"):
        assert (out / name).stat().st_size > 0, name
    html = (out / "report.html").read_text()
    assert "time to first token" in html and "p99" in html
    # locust's own CSV shows the metrics next to the requests. It is written when the run time ends, so requests
    # that finish later (in the stop timeout) are in records.jsonl only: 6 s lets some finish first on a slow
    # machine, where with 3 s none of triton-http's did
    stats_csv = (out / "locust_stats.csv").read_text()
    assert "TTFT" in stats_csv and "ITL" in stats_csv


CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another one?"}],
]


def test_a_dataset_load_sends_its_conversations(gateway, default_model_dir, tmp_path):
    """--dataset: the users send the file's conversations (as the chat template renders them), not synthetic text."""
    from backend.engine.tokenizer import chat_prompt_ids, load_tokenizer

    dataset = tmp_path / "conversations.jsonl"
    dataset.write_text("\n".join(json.dumps({"messages": c}) for c in CONVERSATIONS) + "\n")
    out = tmp_path / "report"
    run = subprocess.run(
        [sys.executable, "-m", "backend.entrypoints.cli", "loadtest", "--target", "gateway", "--host", gateway, "--users", "2",
         "--spawn-rate", "2", "--run-time", "10s", "--out", str(out), "--dataset", str(dataset), "--max-tokens", "1:2",
         "--api-key", GATEWAY_API_KEY],
        capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    tokenizer = load_tokenizer(default_model_dir)
    lengths = {len(chat_prompt_ids(tokenizer, c)) for c in CONVERSATIONS}
    # the users' shared prompt source is seeded: its fifth draw is the first of the other conversation, so six
    # requests hold both (10 s leaves room for a slow machine: 2 requests in 3 s were seen on a cold gateway)
    assert len(records) >= 6 and not [r for r in records if r["error"]]
    assert {r["prompt_tokens"] for r in records} == lengths  # each conversation, and nothing else
    assert all(1 <= r["output_tokens"] <= 2 for r in records)
