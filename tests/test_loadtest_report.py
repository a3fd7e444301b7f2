"""The load-test arithmetic on hand-made records: TTFT, ITL, TPOT, E2E, percentiles, throughput, and the report's
sections. The figures here are worked out by hand from the records' chunk times."""
from __future__ import annotations

import csv
import json

import pytest

from loadtest.records import RequestRecord
from loadtest.report import DEFINITIONS, build_report

RECORDS = [
    RequestRecord("gateway", start=100.0, chunk_times=[0.5, 0.7, 1.0, 1.6], prompt_tokens=10, output_tokens=4),
    RequestRecord("gateway", start=100.2, chunk_times=[0.3, 0.4], prompt_tokens=20, output_tokens=2),
    RequestRecord("gateway", start=101.0, error="HTTP 503"),
    RequestRecord("gateway", start=100.5, chunk_times=[1.0], prompt_tokens=5, output_tokens=1),
]


def test_a_records_own_figures():
    first = RECORDS[0]
    assert (first.ttft, first.e2e) == (0.5, 1.6)
    assert first.itls == pytest.approx([0.2, 0.3, 0.6])
    assert first.tpot == pytest.approx((1.6 - 0.5) / 3)
    assert RECORDS[3].tpot is None  # one token: no time per output token
    assert RECORDS[2].ttft is None and RECORDS[2].e2e is None
    assert json.loads(first.to_json())["tpot"] == pytest.approx(first.tpot)


@pytest.fixture
def report(tmp_path):
    (tmp_path / "records.jsonl").write_text("\n".join(r.to_json() for r in RECORDS))
    settings = {"target": "gateway", "users": 3, "run_time": "15s"}
    return tmp_path, settings, build_report(tmp_path, settings)


def test_summary_figures(report):
    _, _, summary = report
    assert (summary["requests"], summary["errors"]) == (4, 1)
    assert (summary["prompt_tokens"], summary["output_tokens"]) == (35, 7)
    # the run: first send at 100.0, last chunk at 100.0 + 1.6
    assert summary["wall_time_s"] == pytest.approx(1.6)
    assert summary["output_tokens_per_s"] == pytest.approx(7 / 1.6)
    assert summary["requests_per_s"] == pytest.approx(3 / 1.6)
    latency = summary["latency_ms"]
    # TTFT 300, 500, 1000 ms: linear-interpolated percentiles (numpy's default, as vLLM's benchmark)
    assert latency["TTFT"] == pytest.approx({"count": 3, "mean": 600.0, "p50": 500.0, "p90": 900.0, "p99": 990.0})
    # ITL: the gaps 200, 300, 600 (first request) and 100 (second)
    assert latency["ITL"] == pytest.approx({"count": 4, "mean": 300.0, "p50": 250.0, "p90": 510.0, "p99": 591.0})
    # TPOT: (1600 - 500) / 3 and (400 - 300) / 1; a one-token request has none
    assert latency["TPOT"]["count"] == 2 and latency["TPOT"]["mean"] == pytest.approx((1100 / 3 + 100) / 2)
    assert latency["E2E"] == pytest.approx({"count": 3, "mean": 1000.0, "p50": 1000.0, "p90": 1480.0, "p99": 1588.0})


def test_report_files_carry_the_settings_and_the_definitions(report):
    out, settings, summary = report
    html = (out / "report.html").read_text()
    settings_section = html[html.index("<h2>Settings</h2>"):]
    assert all(f"<td>{k}</td><td>{v}</td>" in settings_section for k, v in settings.items())
    definitions_section = html[html.index("<h2>Definitions</h2>"):html.index("<h2>Settings</h2>")]
    assert all(name in definitions_section for name in DEFINITIONS)
    assert "first content chunk − send" in definitions_section
    assert json.loads((out / "summary.json").read_text())["settings"] == settings
    rows = {row[0]: row[1:] for row in csv.reader(open(out / "summary.csv"))}
    assert float(rows["TTFT"][1]) == pytest.approx(600.0) and rows["errors"] == ["1"]
