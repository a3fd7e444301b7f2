"""Triton's Prometheus /metrics, read back: every sample of one or more servers, by metric family (a counter's
family drops its _total). Several servers, or engines (data parallel: one per Triton instance), give several values
of one name. Read by the UI's server panel, the soak's monitor and the disaggregation bench."""
from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Scrape:
    def __init__(self, urls: list[str], timeout: float = 2.0):
        """Raises OSError (with .url: which server did not answer)."""
        self.samples: dict[str, list] = {}
        for url in urls:
            try:
                with urllib.request.urlopen(url, timeout=timeout) as r:
                    text = r.read().decode()
            except OSError as e:
                e.url = url
                raise
            for family in text_string_to_metric_families(text):
                self.samples.setdefault(family.name, []).extend(family.samples)

    def values(self, name: str) -> list[float]:
        return [sample.value for sample in self.samples.get(name, [])]

    def total(self, name: str) -> float:
        return sum(self.values(name))

    def mean(self, name: str) -> float:
        return self.total(name) / max(1, len(self.values(name)))
