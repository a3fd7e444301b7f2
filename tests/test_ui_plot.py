"""The UI's plots: what Gradio sends the browser is numbers on numeric axes, time left to right and tokens/s (or
KV-cache %) from 0 upwards (an untyped frame was drawn as categories: raw floats as ticks, the y axis upside down).
tests/test_ui_conversations.py reads the same off the chart as the browser renders it."""
from __future__ import annotations

import time

import gradio as gr

from ui.chat import UISettings, build_app
from ui.server_metrics import Sample, ServerMetrics


def _plot(app: gr.Blocks, elem_id: str = "throughput-plot") -> gr.LinePlot:
    return next(block for block in app.blocks.values() if getattr(block, "elem_id", None) == elem_id)


def test_throughput_is_temporal_against_quantitative_from_zero():
    plot = _plot(build_app(UISettings()))
    assert plot.y_lim == [0, None] and plot.sort is None
    metrics = ServerMetrics(UISettings().metrics_urls)
    assert plot.postprocess(metrics.throughput()).datatypes == {"time": "temporal", "tokens/s": "quantitative"}

    now = time.time()
    # counter samples 3 s apart, then a restarted server's counter: no rate across the reset
    metrics.samples.extend([Sample(now - 9, 100.0, 0.0), Sample(now - 6, 130.0, 0.0), Sample(now - 3, 190.0, 0.0),
                            Sample(now, 5.0, 0.0)])
    sent = plot.postprocess(metrics.throughput())
    assert sent.datatypes == {"time": "temporal", "tokens/s": "quantitative"}
    (t0, rate0), (t1, rate1) = sent.data
    assert t0 < t1 and abs(t1 / 1000 - (now - 3)) < 1  # epoch milliseconds, in order
    assert (rate0, rate1) == (10.0, 20.0)


def test_kv_cache_usage_is_temporal_against_percent_from_0_to_100():
    plot = _plot(build_app(UISettings()), "kv-cache-plot")
    assert plot.y_lim == [0, 100] and plot.sort is None
    metrics = ServerMetrics(UISettings().metrics_urls)
    assert plot.postprocess(metrics.kv_cache()).datatypes == {"time": "temporal", "KV cache %": "quantitative"}
    now = time.time()
    metrics.samples.extend([Sample(now - 3, 0.0, 0.25), Sample(now, 0.0, 0.5)])
    sent = plot.postprocess(metrics.kv_cache())
    assert [rate for _, rate in sent.data] == [25.0, 50.0]
