"""Ratios, the Markdown table, the JSON file and the plots of one benchmark run."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.roofline import Roofline  # noqa: E402

ORDER = ("in_process", "static", "ensemble_http", "ensemble_grpc")
TARGET_CONCURRENCY = 16


def with_ratios(points: list[dict], limit: Roofline) -> list[dict]:
    """Add the roofline and the ratios against in-process batched generation and the static server."""
    index = {(p["system"], p["workload"], p["concurrency"]): p for p in points}
    for p in points:
        key = (p["workload"], p["concurrency"])
        p["roofline_tokens_per_s"] = limit.tokens_per_s(p["concurrency"])
        p["roofline_fraction"] = p["tokens_per_s"] / p["roofline_tokens_per_s"]
        for base in ("in_process", "static"):
            other = index.get((base, *key))
            p[f"vs_{base}"] = p["tokens_per_s"] / other["tokens_per_s"] if other else None
        static = index.get(("static", *key))
        p["ttft_vs_static"] = p["ttft_p50_ms"] / static["ttft_p50_ms"] if static else None
    return points


def targets(points: list[dict]) -> list[dict]:
    """The engine's acceptance targets at concurrency 16, each with its measured ratio."""
    index = {(p["system"], p["workload"], p["concurrency"]): p for p in points}
    ours = {w: index.get(("ensemble_http", w, TARGET_CONCURRENCY)) for w in ("fixed", "variable")}
    if not all(ours.values()):
        return []
    rows = [
        ("variable: throughput vs static", ours["variable"]["vs_static"], ">=", 1.5),
        ("variable: p50 time to first token vs static", ours["variable"]["ttft_vs_static"], "<=", 0.5),
        ("fixed: throughput vs in-process generate", ours["fixed"]["vs_in_process"], ">=", 0.8),
    ]
    return [{"target": t, "ratio": r, "goal": f"{op} {goal}", "met": r is not None and (r >= goal if op == ">=" else r <= goal)}
            for t, r, op, goal in rows]


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def markdown(results: dict) -> str:
    m, r = results["machine"], results["roofline"]
    lines = [
        f"Benchmark ({results['mode']} mode), {m['date']}: {m['cpu']}, {m['cores']} cores, "
        f"{'GPU' if m['gpu'] else 'no GPU'}, torch {m['torch']}; model {results['model']['params'] / 1e6:.0f}M params "
        f"({results['model']['weight_bytes'] / 2**20:.0f} MiB). Measured peak {r['peak_flops'] / 1e9:.0f} GFLOP/s, "
        f"{r['bandwidth'] / 1e9:.1f} GB/s (ridge at batch {r['ridge_batch']:.0f}).",
        "",
    ]
    for name in ("fixed", "variable"):
        lines += [
            f"**{name}** workload", "",
            "| system | concurrency | tok/s | req/s | p50 ms | p99 ms | TTFT p50 ms | % roofline | vs in-process | vs static | client CPU % |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = sorted((p for p in results["points"] if p["workload"] == name),
                      key=lambda p: (ORDER.index(p["system"]), p["concurrency"]))
        for p in rows:
            lines.append(
                f"| {p['system']} | {p['concurrency']} | {p['tokens_per_s']:.1f} | {p['requests_per_s']:.2f} | "
                f"{p['p50_ms']:.0f} | {p['p99_ms']:.0f} | {p['ttft_p50_ms']:.0f} | {100 * p['roofline_fraction']:.1f} | "
                f"{_ratio(p['vs_in_process'])} | {_ratio(p['vs_static'])} | {p['client_cpu_pct']:.1f} |"
            )
        lines.append("")
    if results.get("targets"):
        lines += [f"Targets at concurrency {TARGET_CONCURRENCY} (`ensemble_http`):", "",
                  "| target | measured | goal | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {_ratio(t['ratio'])} | {t['goal']} | {'yes' if t['met'] else 'no'} |"
                  for t in results["targets"]]
        lines.append("")
    lines += ["Server side (Triton statistics, mean ms per request, `ensemble_http`):", "",
              "| workload | concurrency | model | executions / requests | queue ms | compute ms |", "|---|---|---|---|---|---|"]
    for p in results["points"]:
        if p["system"] == "ensemble_http":
            for model, s in p["server"].items():
                lines.append(f"| {p['workload']} | {p['concurrency']} | {model} | {s['executions']} / {s['requests']} | "
                             f"{s['queue_ms']:.1f} | {s['compute_ms']:.1f} |")
    o = results["ensemble_overhead"]
    lines += ["", f"Ensemble overhead (fixed workload, concurrency 1, p50): llm direct {o['llm_p50_ms']:.1f} ms, "
              f"through the ensemble {o['ensemble_p50_ms']:.1f} ms: {o['overhead_ms']:+.1f} ms ({o['overhead_pct']:+.1f}%)."]
    x = results.get("perf_analyzer_cross_check")
    if x:
        pa = x["perf_analyzer"]
        if "error" in pa:
            lines += ["", f"perf_analyzer cross-check failed: {pa['error'][-300:]}"]
        else:
            lines += ["", f"perf_analyzer cross-check ({x['workload']}, concurrency {x['concurrency']}): "
                      f"{pa['requests_per_s']:.2f} req/s, p50 {pa['p50_ms']:.0f} ms; our load generator "
                      f"{x['ours_requests_per_s']:.2f} req/s, p50 {x['ours_p50_ms']:.0f} ms "
                      f"(ratio {x['ours_requests_per_s'] / pa['requests_per_s']:.2f})."]
    return "\n".join(lines) + "\n"


def plots(results: dict, out: Path) -> None:
    points = results["points"]
    for name in ("fixed", "variable"):
        fig, (tput, lat, first) = plt.subplots(1, 3, figsize=(16, 4.5))
        for system in ORDER:
            rows = sorted((p for p in points if p["system"] == system and p["workload"] == name), key=lambda p: p["concurrency"])
            if rows:
                tput.plot([p["concurrency"] for p in rows], [p["tokens_per_s"] for p in rows], marker="o", label=system)
                lat.plot([p["tokens_per_s"] for p in rows], [p["p50_ms"] for p in rows], marker="o", label=system)
                first.plot([p["concurrency"] for p in rows], [p["ttft_p50_ms"] for p in rows], marker="o", label=system)
        rows = sorted({p["concurrency"]: p["roofline_tokens_per_s"] for p in points}.items())
        tput.plot([c for c, _ in rows], [v for _, v in rows], "k--", label="roofline")
        tput.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="output tokens/s", title=f"{name}: throughput")
        lat.set(yscale="log", xlabel="output tokens/s", ylabel="p50 latency (ms)", title=f"{name}: latency vs throughput")
        first.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="p50 time to first token (ms)",
                  title=f"{name}: time to first token")
        for ax in (tput, lat, first):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


def write(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    plots(results, out)
