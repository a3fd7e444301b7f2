"""One request's timings, measured the way vLLM's serving benchmark and GenAI-Perf measure them.

TTFT = first content chunk - send; ITL = gaps between consecutive content chunks;
TPOT = (E2E - TTFT) / (output tokens - 1); E2E = last chunk - send.
Token counts come from the server (usage / num_*_tokens outputs), never estimated.
"""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class RequestRecord:
    target: str
    start: float  # wall-clock send time (epoch seconds)
    chunk_times: list[float] = field(default_factory=list)  # seconds after start, content chunks only
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times[-1] if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    @property
    def tpot(self) -> float | None:
        if not self.chunk_times or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "ttft": self.ttft, "e2e": self.e2e, "tpot": self.tpot})


class Timer:
    """Stamps content chunks of one request relative to its send time."""

    def __init__(self, record: RequestRecord):
        self.record = record
        self._t0 = time.perf_counter()
        record.start = time.time()

    def chunk(self) -> None:
        self.record.chunk_times.append(time.perf_counter() - self._t0)


def load_records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
