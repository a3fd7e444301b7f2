"""Load-test report: JSON and CSV summaries, PNG plots and one HTML page, from records.jsonl + users.json."""
from __future__ import annotations

import argparse
import csv
import html
import json
from pathlib import Path

import numpy as np

from loadtest.records import load_records

DEFINITIONS = {
    "TTFT": "time to first token: first content chunk − send",
    "ITL": "inter-token latency: gap between consecutive content chunks",
    "TPOT": "time per output token: (E2E − TTFT) / (output tokens − 1)",
    "E2E": "end-to-end latency: last chunk − send",
    "output tokens/s": "Σ output tokens (counted by the server) / wall time of the run",
}
PERCENTILES = (50, 90, 99)


def _stats(values: list[float]) -> dict:
    if not values:
        return {"count": 0, "mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1000
    return {"count": len(values), "mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(records: list[dict]) -> dict:
    ok = [r for r in records if not r["error"] and r["chunk_times"]]
    starts = [r["start"] for r in records]
    ends = [r["start"] + r["chunk_times"][-1] for r in ok]
    wall = (max(ends) - min(starts)) if ok else 0.0
    output_tokens = sum(r["output_tokens"] for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "output_tokens": output_tokens,
        "wall_time_s": wall,
        "output_tokens_per_s": output_tokens / wall if wall else 0.0,
        "requests_per_s": len(ok) / wall if wall else 0.0,
        "latency_ms": {
            "TTFT": _stats([r["chunk_times"][0] for r in ok]),
            "ITL": _stats([b - a for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])]),
            "TPOT": _stats([r["tpot"] for r in ok if r["tpot"] is not None]),
            "E2E": _stats([r["chunk_times"][-1] for r in ok]),
        },
    }


def _plots(records: list[dict], users: list, out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if not r["error"] and r["chunk_times"]]
    names = []
    for key, values in (("ttft", [r["chunk_times"][0] * 1000 for r in ok]),
                        ("itl", [(b - a) * 1000 for r in ok for a, b in zip(r["chunk_times"], r["chunk_times"][1:])])):
        fig, ax = plt.subplots(figsize=(6, 3.2))
        ax.hist(values, bins=40, color="#e8710a")
        ax.set_xlabel(f"{key.upper()} (ms)")
        ax.set_ylabel("count")
        ax.set_title(f"{key.upper()} distribution")
        fig.tight_layout()
        fig.savefig(out / f"{key}_hist.png", dpi=100)
        plt.close(fig)
        names.append(f"{key}_hist.png")

    t0 = min((r["start"] for r in records), default=0.0)
    # each request's server-counted tokens, spread over its content chunks
    stamps, weights = [], []
    for r in ok:
        share = r["output_tokens"] / len(r["chunk_times"])
        stamps += [r["start"] + c - t0 for c in r["chunk_times"]]
        weights += [share] * len(r["chunk_times"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 5), sharex=True)
    if stamps:
        bins = np.arange(0, max(stamps) + 1.0, 1.0)
        counts, edges = np.histogram(stamps, bins=bins if len(bins) > 1 else 1, weights=weights)
        top.plot(edges[:-1], counts, color="#1a73e8")
    top.set_ylabel("output tokens/s")
    top.set_title("Throughput and load over time")
    if users:
        bottom.step([t - t0 for t, _ in users], [n for _, n in users], where="post", color="#188038")
    bottom.set_ylabel("active users")
    bottom.set_xlabel("seconds since start")
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)
    names.append("throughput.png")
    return names


def _html(summary: dict, settings: dict, plots: list[str]) -> str:
    def fmt(v):
        return "–" if v is None else f"{v:.1f}"

    rows = "".join(
        f"<tr><td>{name}</td><td>{s['count']}</td><td>{fmt(s['mean'])}</td>"
        + "".join(f"<td>{fmt(s[f'p{p}'])}</td>" for p in PERCENTILES) + "</tr>"
        for name, s in summary["latency_ms"].items())
    totals = "".join(f"<tr><td>{html.escape(k)}</td><td>{v:.2f}</td></tr>" if isinstance(v, float)
                     else f"<tr><td>{html.escape(k)}</td><td>{v}</td></tr>"
                     for k, v in summary.items() if k != "latency_ms")
    definitions = "".join(f"<li><b>{k}</b>: {html.escape(v)}</li>" for k, v in DEFINITIONS.items())
    setting_rows = "".join(f"<tr><td>{html.escape(str(k))}</td><td>{html.escape(str(v))}</td></tr>"
                           for k, v in settings.items())
    images = "".join(f'<img src="{p}" alt="{p}">' for p in plots)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>npu-llm load test</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:1000px}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:4px 10px;text-align:right}}td:first-child{{text-align:left}}img{{margin:6px}}</style>
</head><body><h1>npu-llm load test</h1>
<h2>Latency (ms)</h2><table><tr><th>metric</th><th>count</th><th>mean</th>{''.join(f'<th>p{p}</th>' for p in PERCENTILES)}</tr>{rows}</table>
<h2>Totals</h2><table>{totals}</table>
<h2>Plots</h2>{images}
<h2>Definitions</h2><ul>{definitions}</ul>
<h2>Settings</h2><table>{setting_rows}</table></body></html>"""


def build_report(out: Path, settings: dict) -> dict:
    """Reads out/records.jsonl and out/users.json; writes summary.json, summary.csv, *.png, report.html."""
    out = Path(out)
    records = load_records(out / "records.jsonl")
    users = json.loads((out / "users.json").read_text()) if (out / "users.json").exists() else []
    summary = summarize(records)
    (out / "summary.json").write_text(json.dumps({"summary": summary, "settings": settings,
                                                  "definitions": DEFINITIONS}, indent=2))
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["metric", "count", "mean_ms", *[f"p{p}_ms" for p in PERCENTILES]])
        for name, s in summary["latency_ms"].items():
            writer.writerow([name, s["count"], s["mean"], *[s[f"p{p}"] for p in PERCENTILES]])
        for key in ("requests", "errors", "prompt_tokens", "output_tokens", "wall_time_s", "output_tokens_per_s",
                    "requests_per_s"):
            writer.writerow([key, summary[key]])
    plots = _plots(records, users, out)
    (out / "report.html").write_text(_html(summary, settings, plots))
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description="Rebuild a load-test report from its records.")
    parser.add_argument("out_dir")
    args = parser.parse_args()
    settings_file = Path(args.out_dir) / "summary.json"
    settings = json.loads(settings_file.read_text()).get("settings", {}) if settings_file.exists() else {}
    print(json.dumps(build_report(Path(args.out_dir), settings)["latency_ms"], indent=2))


if __name__ == "__main__":
    main()
