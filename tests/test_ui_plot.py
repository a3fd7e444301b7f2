"""The UI's throughput plot: what Gradio sends the browser is numbers on numeric axes, time left to right and
tokens/s from 0 upwards (an untyped frame was drawn as categories: raw floats as ticks, the y axis upside down)."""
from __future__ import annotations

import time

import gradio as gr

from ui.chat import ChatBackend, UISettings, build_app


def _plot(app: gr.Blocks) -> gr.LinePlot:
    return next(block for block in app.blocks.values() if getattr(block, "elem_id", None) == "throughput-plot")


def test_throughput_is_temporal_against_quantitative_from_zero():
    plot = _plot(build_app(UISettings()))
    assert plot.y_lim == [0, None] and plot.sort is None
    backend = ChatBackend(UISettings())
    assert plot.postprocess(backend.throughput()).datatypes == {"time": "temporal", "tokens/s": "quantitative"}

    now = time.time()
    backend.samples.extend([(now - 6, 100.0), (now - 3, 130.0), (now, 190.0)])  # counter samples, 3 s apart
    sent = plot.postprocess(backend.throughput())
    assert sent.datatypes == {"time": "temporal", "tokens/s": "quantitative"}
    (t0, rate0), (t1, rate1) = sent.data
    assert t0 < t1 and abs(t1 / 1000 - now) < 1  # epoch milliseconds, in order
    assert (rate0, rate1) == (10.0, 20.0)
