"""Profile captures of the engine: a trace for Perfetto, and a table of where each step's time went.

`LLM.start_profile()` / `LLM.stop_profile()` (and `npu-llm bench throughput --profile DIR`, and a served
model's `profile_dir` engine argument with the gateway's /start_profile and /stop_profile) bracket a
capture. Between them:

- torch.profiler (torch_npu.profiler on Ascend, as vllm-ascend's worker runs it) records every step;
  the trace opens in Perfetto or chrome://tracing: DIR/trace-<time>.json on CPU and CUDA, torch_npu's
  DIR/<worker>_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json on the NPU;
- the engine's named scopes (npu_llm_kernels/timing.py) time each step's parts, waiting for the device at
  each scope's ends, so the figures are the device's work and not its launch queue. That wait slows a
  captured run a little on an accelerator; the CPU has nothing to wait for.

The table splits the time by step kind (prefill-only, decode-only, mixed) into ms per step and % of the
capture's wall time. A mixed step's matmuls run over prefill and decode tokens at once: they are split
between the two rows in proportion to those tokens. Decode steps replayed as device graphs run no
Python scopes: their whole forward pass counts under "norms, rotary, activation". Where the MLP's activation rides
in its matmul (bf16 weights in stripes, docs/devices.md), it counts with the matmuls.
"""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from backend.platform import Platform
from npu_llm_kernels import timing

log = logging.getLogger(__name__)

STEP_KINDS = ("prefill-only", "decode-only", "mixed")
# Table rows, each the scopes whose self time it sums; "matmul" is split between the first two rows.
ROWS = {
    "prefill matmuls": (),
    "decode matmuls": (),
    "prefill attention": ("attention.prefill",),
    "decode attention": ("attention.decode",),
    "norms, rotary, activation": ("forward",),
    "TP all-reduce, all-gather": ("all_reduce", "all_gather"),
    # MoE layers (on the CPU dispatch and combine are inside the one fused-experts call)
    "MoE router": ("moe.router",),
    "MoE dispatch": ("moe.dispatch",),
    "MoE experts": ("moe.experts",),
    "MoE combine": ("moe.combine",),
    "LoRA adapters": ("lora",),
    "sampler": ("sample",),
    "scheduler, Python bookkeeping": ("schedule", "prepare", "step"),
    "detokenization": ("detokenize",),
}


@dataclass
class StepRecord:
    kind: str
    num_prefill_tokens: int
    num_decode_tokens: int
    scopes: dict[str, float]  # self seconds per scope name

    def row_seconds(self) -> dict[str, float]:
        rows = {row: sum(self.scopes.get(s, 0.0) for s in names) for row, names in ROWS.items()}
        matmul = self.scopes.get("matmul", 0.0)
        tokens = self.num_prefill_tokens + self.num_decode_tokens
        rows["prefill matmuls"] = matmul * self.num_prefill_tokens / tokens if tokens else 0.0
        rows["decode matmuls"] = matmul - rows["prefill matmuls"]
        return rows

    @property
    def seconds(self) -> float:
        return sum(self.scopes.values())


@dataclass
class ProfileResult:
    trace_path: str
    wall_s: float  # from start to stop
    steps: list[StepRecord] = field(default_factory=list)
    expert_load: list[int] = field(default_factory=list)  # MoE: (token, expert) pairs per rank in the capture

    def breakdown(self) -> dict[str, dict[str, dict[str, float]]]:
        """{step kind or "all": {row: {"ms_per_step", "pct_wall"}}}, with a "step total" row."""
        out = {}
        for kind in STEP_KINDS + ("all",):
            steps = [s for s in self.steps if kind in ("all", s.kind)]
            if not steps:
                continue
            sums: dict[str, float] = dict.fromkeys(list(ROWS) + ["step total"], 0.0)
            for step in steps:
                for row, seconds in step.row_seconds().items():
                    sums[row] += seconds
                sums["step total"] += step.seconds
            out[kind] = {
                row: {"ms_per_step": 1e3 * s / len(steps), "pct_wall": 100 * s / self.wall_s if self.wall_s else 0.0}
                for row, s in sums.items()
            }
            out[kind]["steps"] = {"count": len(steps)}
        return out

    def table(self) -> str:
        breakdown = self.breakdown()
        kinds = [k for k in STEP_KINDS + ("all",) if k in breakdown]
        titles = [f"{kind} ({breakdown[kind]['steps']['count']} steps)" for kind in kinds]
        head = f"{'':31}" + "".join(f"{title:>24}" for title in titles)
        sub = f"{'':31}" + "".join(f"{'ms/step':>14}{'% wall':>10}" for _ in kinds)
        lines = [
            f"npu-llm profile: {len(self.steps)} steps in {self.wall_s:.2f} s wall; trace {self.trace_path}",
            head, sub,
        ]
        for row in list(ROWS) + ["step total"]:
            if row.startswith("MoE") and not any(breakdown[k][row]["ms_per_step"] for k in kinds):
                continue  # a dense model, or a platform without that piece
            cells = "".join(
                f"{breakdown[k][row]['ms_per_step']:>14.2f}{breakdown[k][row]['pct_wall']:>9.1f}%" for k in kinds
            )
            lines.append(f"{row:31}{cells}")
        if len(self.expert_load) > 1:
            total = sum(self.expert_load) or 1
            lines.append("MoE expert load per rank (token, expert pairs): " + ", ".join(
                f"rank {r} {n} ({100 * n / total:.0f}%)" for r, n in enumerate(self.expert_load)))
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"trace_path": self.trace_path, "wall_s": self.wall_s, "num_steps": len(self.steps),
                "breakdown": self.breakdown(), "expert_load": self.expert_load}


class Profiler:
    """One capture at a time, writing under `out_dir`."""

    def __init__(self, platform: Platform, out_dir: str | os.PathLike):
        self.platform = platform
        self.out_dir = Path(out_dir)
        self._trace = None
        self._recorder: timing.Recorder | None = None
        self._steps: list[StepRecord] = []
        self._start = 0.0
        self._load_at_start: list[int] = []
        self._captures = 0

    @property
    def active(self) -> bool:
        return self._recorder is not None

    def start(self, expert_load: list[int] = ()) -> None:
        """`expert_load`: the model's expert_load() now, so that stop() can report the capture's share."""
        if self.active:
            raise RuntimeError("a profile capture is already running")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._trace = self._trace_profiler()
        self._trace.start()
        self._recorder = timing.Recorder(self.platform.synchronize)
        timing.install(self._recorder)
        self._steps = []
        self._load_at_start = list(expert_load)
        self._start = time.perf_counter()
        log.info("profiling started; trace and table go to %s", self.out_dir)

    def step_done(self, num_prefill_tokens: int, num_decode_tokens: int, seconds: float) -> None:
        """Called by the engine after each step it ran while a capture is on, with the step's wall time:
        what no scope covered (the scopes' own entry and exit among it) counts as the step's bookkeeping."""
        kind = ("mixed" if num_decode_tokens else "prefill-only") if num_prefill_tokens else "decode-only"
        scopes = self._recorder.take()
        scopes["step"] = scopes.get("step", 0.0) + max(0.0, seconds - sum(scopes.values()))
        self._steps.append(StepRecord(kind, num_prefill_tokens, num_decode_tokens, scopes))

    def stop(self, expert_load: list[int] = ()) -> ProfileResult:
        if not self.active:
            raise RuntimeError("no profile capture is running")
        wall = time.perf_counter() - self._start
        timing.install(None)
        self._recorder = None
        self._trace.stop()
        self._captures += 1
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self._captures}"
        load = [n - before for n, before in zip(expert_load, self._load_at_start)]
        result = ProfileResult(self._export_trace(stamp), wall, self._steps, load)
        (self.out_dir / f"breakdown-{stamp}.txt").write_text(result.table() + "\n")
        (self.out_dir / f"breakdown-{stamp}.json").write_text(json.dumps(result.to_dict(), indent=1))
        log.info("profile written:\n%s", result.table())
        return result

    def _trace_profiler(self):
        if self.platform.name == "npu":
            from torch_npu import profiler as npu_profiler

            activities = [npu_profiler.ProfilerActivity.CPU, npu_profiler.ProfilerActivity.NPU]
            return npu_profiler.profile(
                activities=activities, on_trace_ready=npu_profiler.tensorboard_trace_handler(str(self.out_dir))
            )
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.platform.name == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=activities)

    def _export_trace(self, stamp: str) -> str:
        if self.platform.name == "npu":  # torch_npu's handler wrote it on stop
            traces = sorted(self.out_dir.glob("*_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json"),
                            key=os.path.getmtime)
            return str(traces[-1]) if traces else str(self.out_dir)
        path = self.out_dir / f"trace-{stamp}.json"
        self._trace.export_chrome_trace(str(path))
        return str(path)
