"""Ratios, the goals of the engine, the Markdown table, the JSON file and the plots of one benchmark run."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from bench.roofline import Roofline, engine_dtype  # noqa: E402

OURS = "ensemble_http"
ORDER = ("in_process", "static", "ensemble_http", "ensemble_grpc", "openai_http", "guidellm_openai", "llama_server_bf16",
         "llama_server_f32", "vllm", "ensemble_http_bf16", "ensemble_http_int8", "llama_server_q8_0", "ensemble_http_int4",
         "llama_server_q4_1")
PEERS = ("llama_server_bf16", "llama_server_f32")  # "the best of its F32/BF16 runs"
# Our weights setting and llama.cpp's type of the same bits (bench/quantized.py); make bench's full mode runs
# the quantized two, its main sweep already holding our automatic dtype against llama-server BF16.
QUANTIZED_PAIRS = (("bf16", "BF16"), ("int8", "Q8_0"), ("int4", "Q4_1"))
# Each pair's goal by concurrency: issue 32's for int8 and int4, issue 44's for bf16 and the shipped file (int4).
WEIGHT_GOALS = {("bf16", 1): 1.0, ("int8", 1): 1.0, ("int8", 16): 1.5, ("int8", 64): 1.5, ("int4", 1): 1.0,
                ("int4", 16): 1.5, ("int4", 64): 1.5}
# bench/quantized.py's systems: each against its own pair, not PEERS.
COUNTERPART = {f"ensemble_http_{setting}": f"llama_server_{kind.lower()}" for setting, kind in QUANTIZED_PAIRS}
# p50 time to first token of ensemble_http at concurrency 16 before this engine (2026-12-02 run, the
# previous docs/benchmark/results.json): the scaling goal keeps it from getting worse.
PREVIOUS_TTFT_MS = {"fixed": 1414.0, "variable": 597.0}


def with_ratios(points: list[dict], rooflines: dict[str, Roofline], contexts: dict[str, float]) -> list[dict]:
    """Add each point's roofline (its own dtype, its workload's mean context) and its ratios against
    in-process batched generation, the static server and the best llama-server run."""
    index = {(p["system"], p["workload"], p["concurrency"]): p for p in points}
    for p in points:
        key = (p["workload"], p["concurrency"])
        limit = rooflines[p["dtype"]].tokens_per_s(p["concurrency"], contexts[p["workload"]])
        p["roofline_tokens_per_s"], p["roofline_fraction"] = limit, p["tokens_per_s"] / limit
        for base in ("in_process", "static"):
            other = index.get((base, *key))
            p[f"vs_{base}"] = p["tokens_per_s"] / other["tokens_per_s"] if other else None
        against = (COUNTERPART[p["system"]],) if p["system"] in COUNTERPART else PEERS
        peer = max((index[(s, *key)] for s in against if (s, *key) in index), key=lambda q: q["tokens_per_s"], default=None)
        p["vs_llama_server"] = p["tokens_per_s"] / peer["tokens_per_s"] if peer else None
        static = index.get(("static", *key))
        p["ttft_vs_static"] = p["ttft_p50_ms"] / static["ttft_p50_ms"] if static else None
    return points


def targets(points: list[dict]) -> list[dict]:
    """The goals of issue 10, each with its measured ratio; a goal whose points were not run is left out."""
    index = {(p["system"], p["workload"], p["concurrency"]): p for p in points}

    def ours(name: str, c: int) -> dict | None:
        return index.get((OURS, name, c))

    rows = []

    def goal(text: str, point: dict | None, key: str, op: str, bound: float) -> None:
        value = point and point.get(key)
        if value is not None:
            met = value >= bound if op == ">=" else value > bound if op == ">" else value <= bound
            rows.append({"target": text, "ratio": value, "goal": f"{op} {bound:g}", "met": met})

    goal("fixed c=16: throughput vs best llama-server", ours("fixed", 16), "vs_llama_server", ">=", 2.0)
    goal("fixed c=16: throughput vs in-process generate", ours("fixed", 16), "vs_in_process", ">=", 1.2)
    goal("fixed c=1: throughput vs best llama-server", ours("fixed", 1), "vs_llama_server", ">=", 1.0)
    goal("variable c=16: throughput vs static Triton", ours("variable", 16), "vs_static", ">=", 1.5)
    goal("variable c=16: throughput vs best llama-server", ours("variable", 16), "vs_llama_server", ">", 1.0)
    for name in ("fixed", "variable"):
        steps = [ours(name, c) for c in (16, 32, 64)]
        if all(steps):
            rates = [p["tokens_per_s"] for p in steps]
            rows.append({"target": f"{name}: throughput rises c=16 -> 32 -> 64", "ratio": rates[2] / rates[0],
                         "goal": "rising", "met": rates[0] < rates[1] < rates[2],
                         "detail": " -> ".join(f"{r:.0f}" for r in rates)})
        now = ours(name, 16)
        if now:
            rows.append({"target": f"{name} c=16: p50 time to first token vs before this engine",
                         "ratio": now["ttft_p50_ms"] / PREVIOUS_TTFT_MS[name], "goal": "<= 1",
                         "met": now["ttft_p50_ms"] <= PREVIOUS_TTFT_MS[name],
                         "detail": f"{now['ttft_p50_ms']:.0f} ms vs {PREVIOUS_TTFT_MS[name]:.0f} ms"})
    return rows


def openai_rows(points: list[dict]) -> list[dict]:
    """The OpenAI endpoint against generate_stream (its own overhead), and guidellm against our client on it."""
    index = {(p["system"], p["workload"], p["concurrency"]): p for p in points}
    rows = []
    for c in sorted(p["concurrency"] for p in points if p["system"] == "openai_http" and p["workload"] == "fixed"):
        ours, base, tool = (index.get((s, "fixed", c)) for s in ("openai_http", OURS, "guidellm_openai"))
        rows.append({
            "concurrency": c, "openai_tokens_per_s": ours["tokens_per_s"], "openai_ttft_p50_ms": ours["ttft_p50_ms"],
            "generate_stream_tokens_per_s": base and base["tokens_per_s"],
            "vs_generate_stream": base and ours["tokens_per_s"] / base["tokens_per_s"],
            "ttft_added_ms": base and ours["ttft_p50_ms"] - base["ttft_p50_ms"],
            "guidellm_tokens_per_s": tool and tool["tokens_per_s"], "guidellm_ttft_p50_ms": tool and tool["ttft_p50_ms"],
            "guidellm_vs_ours": tool and tool["tokens_per_s"] / ours["tokens_per_s"],
        })
    return rows


def chat_targets(rows: list[dict]) -> list[dict]:
    """Issue 24's goals on the chat workload: our later turns no slower than 1.2x our first turns, and our
    later-turn TTFT p50 and throughput ahead of every peer that ran, at each concurrency."""
    ours = {r["concurrency"]: r for r in rows if r["system"] == "openai_http" and r["prefix_caching"]}
    found = []
    for c, us in sorted(ours.items()):
        found.append({"target": f"chat c={c}: later-turn / first-turn TTFT p50 (ours)", "ratio": us["later_over_first"],
                      "goal": "<= 1.2", "met": us["later_over_first"] <= 1.2,
                      "detail": f"{us['ttft_p50_later_ms']:.0f} / {us['ttft_p50_first_ms']:.0f} ms"})
        for peer in (r for r in rows if r["concurrency"] == c and r["system"] != "openai_http"):
            later = us["ttft_p50_later_ms"] / peer["ttft_p50_later_ms"]
            found.append({"target": f"chat c={c}: later-turn TTFT p50, ours / {peer['system']}", "ratio": later,
                          "goal": "< 1", "met": later < 1,
                          "detail": f"{us['ttft_p50_later_ms']:.0f} vs {peer['ttft_p50_later_ms']:.0f} ms"})
            rate = us["tokens_per_s"] / peer["tokens_per_s"]
            found.append({"target": f"chat c={c}: throughput, ours / {peer['system']}", "ratio": rate, "goal": "> 1",
                          "met": rate > 1, "detail": f"{us['tokens_per_s']:.1f} vs {peer['tokens_per_s']:.1f} tok/s"})
    return found


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def quantized_rows(points: list[dict], limits: dict[str, Roofline], contexts: dict[str, float]) -> list[dict]:
    """One row per pair and concurrency: both systems' tok/s, their ratio, bytes a step and rooflines."""
    found = {(p["system"], p["concurrency"]): p for p in points if p["workload"] == "fixed"}
    table = []
    for setting, kind in QUANTIZED_PAIRS:
        if setting not in limits:
            continue
        system = f"ensemble_http_{setting}"
        for c in sorted({c for s, c in found if s == system}):
            ours, theirs = found.get((system, c)), found.get((COUNTERPART[system], c))
            row = {"setting": setting, "peer": kind, "concurrency": c}
            for who, name, p in (("ours", setting, ours), ("peer", kind, theirs)):
                bound = limits[name].tokens_per_s(c, contexts["fixed"])
                row |= {f"{who}_weight_mib": limits[name].weight_bytes / 2**20,
                        f"{who}_tokens_per_s": p["tokens_per_s"] if p else None,
                        f"{who}_roofline_fraction": p["tokens_per_s"] / bound if p else None}
            row["ratio"] = ours["tokens_per_s"] / theirs["tokens_per_s"] if ours and theirs else None
            row["goal"] = WEIGHT_GOALS.get((setting, c))
            table.append(row)
    return table


def quantized_markdown(table: list[dict]) -> list[str]:
    num = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    lines = ["Quantized weights (fixed workload, `generate_stream` against llama-server on the same bits; "
             "% of each one's roofline for the bytes it reads a step):", "",
             "| ours | llama.cpp | concurrency | ours tok/s | llama-server tok/s | ours / llama-server | goal | "
             "MiB read a step (ours / llama.cpp) | % roofline (ours / llama.cpp) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        met = r["ratio"] is not None and r["goal"] is not None and r["ratio"] >= r["goal"]
        goal = "-" if r["goal"] is None else f"{r['goal']:.1f}x ({'met' if met else '**missed**'})"
        lines.append(
            f"| {r['setting']} | {r['peer']} | {r['concurrency']} | {num(r['ours_tokens_per_s'], '.1f')} | "
            f"{num(r['peer_tokens_per_s'], '.1f')} | {num(r['ratio'], '.2f')}x | {goal} | "
            f"{r['ours_weight_mib']:.0f} / {r['peer_weight_mib']:.0f} | "
            f"{num(r['ours_roofline_fraction'] and 100 * r['ours_roofline_fraction'], '.1f')} / "
            f"{num(r['peer_roofline_fraction'] and 100 * r['peer_roofline_fraction'], '.1f')} |")
    return lines + [""]


def engine(results: dict) -> str:
    """The dtype our engine's points carry (results from before weights were recorded: auto)."""
    return engine_dtype(results["model"]["dtype"], results["model"].get("weights", "auto"))


def markdown(results: dict) -> str:
    m = results["machine"]
    lines = [
        f"Benchmark ({results['mode']} mode), {m['date']}: {m['cpu']} ({', '.join(m['cpu_features']) or 'no AVX2'}; "
        f"{m.get('kernels', 'kernels not recorded')}), "
        f"{m['cores']} cores, {'GPU' if m['gpu'] else 'no GPU'}, torch {m['torch']}; model "
        f"{results['model']['params'] / 1e6:.0f}M params, our engine in {engine(results)}.",
        "",
        "Rooflines (measured peak GEMM FLOP/s in the dtype, and read bandwidth):",
        "",
    ]
    lines += [f"- {name}: {r['peak_flops'] / 1e9:.0f} GFLOP/s, {r['bandwidth'] / 1e9:.1f} GB/s, weights "
              f"{r['weight_bytes'] / 2**20:.0f} MiB (ridge at batch {r['ridge_batch']:.0f})"
              for name, r in results["roofline"].items()]
    lines.append("")
    for name in [n for n in ("fixed", "variable", "sampled", "structured") if n in results["contexts"]]:
        lines += [
            f"**{name}** workload (mean context {results['contexts'][name]:.0f} tokens)", "",
            "| system | dtype | concurrency | tok/s | req/s | p50 ms | p99 ms | TTFT p50 ms | % roofline | vs llama-server | vs in-process | vs static | client CPU % |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        rows = sorted((p for p in results["points"] if p["workload"] == name),
                      key=lambda p: (ORDER.index(p["system"]), p["concurrency"]))
        for p in rows:
            lines.append(
                f"| {p['system']} | {p['dtype']} | {p['concurrency']} | {p['tokens_per_s']:.1f} | {p['requests_per_s']:.2f} | "
                f"{p['p50_ms']:.0f} | {p['p99_ms']:.0f} | {p['ttft_p50_ms']:.0f} | {100 * p['roofline_fraction']:.1f} | "
                f"{_ratio(p['vs_llama_server'])} | {_ratio(p['vs_in_process'])} | {_ratio(p['vs_static'])} | "
                f"{p['client_cpu_pct']:.1f} |"
            )
        lines.append("")
    if results.get("quantized"):
        lines += quantized_markdown(results["quantized"])
    if results.get("targets"):
        lines += [f"Goals (`{OURS}`):", "", "| goal | measured | required | met |", "|---|---|---|---|"]
        lines += [f"| {t['target']} | {_ratio(t['ratio'])}{' (' + t['detail'] + ')' if t.get('detail') else ''} | "
                  f"{t['goal']} | {'yes' if t['met'] else '**no**'} |" for t in results["targets"]]
        lines.append("")
    if results.get("openai"):
        lines += ["OpenAI endpoint (fixed workload, streamed `/v1/chat/completions`): its throughput against "
                  "`generate_stream` on the same server, and vLLM's guidellm against our load generator on it:", "",
                  "| concurrency | generate_stream tok/s | OpenAI tok/s (ours) | OpenAI / generate_stream | TTFT added ms | "
                  "OpenAI tok/s (guidellm) | guidellm / ours |", "|---|---|---|---|---|---|---|"]
        num = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        lines += [f"| {r['concurrency']} | {num(r['generate_stream_tokens_per_s'], '.1f')} | {r['openai_tokens_per_s']:.1f} | "
                  f"{_ratio(r['vs_generate_stream'])} | {num(r['ttft_added_ms'], '+.0f')} | {num(r['guidellm_tokens_per_s'], '.1f')} | "
                  f"{_ratio(r['guidellm_vs_ours'])} |" for r in results["openai"]]
        lines.append("")
    if results.get("chat"):
        r0 = results["chat"][0]
        lines += [f"**chat** workload (`bench/chat.py`: at concurrency c, 2c conversations of {r0['turns'] // r0['conversations']} "
                  f"turns over one ~400-token system prompt, each turn re-sending the history; {r0['max_tokens']}-token "
                  "replies, streamed `/v1/chat/completions`, closed loop):", "",
                  "| system | dtype | prefix cache | concurrency | tok/s | TTFT p50 first turns ms | later turns ms | "
                  "later / first | TTFT p99 ms | mean prompt tokens | prompt tokens cached | client CPU % |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        order = lambda r: (ORDER.index(r["system"]), not r["prefix_caching"], r["concurrency"])  # noqa: E731
        for r in sorted(results["chat"], key=order):
            share = "" if r["cached_share"] is None else f"{100 * r['cached_share']:.0f}%"
            lines.append(f"| {r['system']} | {r['dtype']} | {'on' if r['prefix_caching'] else 'off'} | {r['concurrency']} | "
                         f"{r['tokens_per_s']:.1f} | {r['ttft_p50_first_ms']:.0f} | {r['ttft_p50_later_ms']:.0f} | "
                         f"{r['later_over_first']:.2f}x | {r['ttft_p99_ms']:.0f} | {r['prompt_tokens_mean']:.0f} | {share} | "
                         f"{r['client_cpu_pct']:.1f} |")
        lines.append("")
        if results.get("chat_targets"):
            lines += ["Goals on the chat workload:", "", "| goal | measured | required | met |", "|---|---|---|---|"]
            lines += [f"| {t['target']} | {_ratio(t['ratio'])} ({t['detail']}) | {t['goal']} | "
                      f"{'yes' if t['met'] else '**no**'} |" for t in results["chat_targets"]]
            lines.append("")
    for peer in results.get("peers", []):
        lines.append(f"- {peer['system']}: {peer['status']}")
    lines += ["", f"Server side (Triton statistics, mean ms per request, `{OURS}`):", "",
              "| workload | concurrency | model | executions / requests | queue ms | compute ms |", "|---|---|---|---|---|---|"]
    for p in results["points"]:
        if p["system"] == OURS:
            for model, s in p["server"].items():
                lines.append(f"| {p['workload']} | {p['concurrency']} | {model} | {s['executions']} / {s['requests']} | "
                             f"{s['queue_ms']:.1f} | {s['compute_ms']:.1f} |")
    o = results["ensemble_overhead"]
    lines += ["", f"Ensemble overhead (fixed workload, concurrency 1, p50): llm direct {o['llm_p50_ms']:.1f} ms, "
              f"through the ensemble {o['ensemble_p50_ms']:.1f} ms: {o['overhead_ms']:+.1f} ms ({o['overhead_pct']:+.1f}%).",
              "", f"Ensemble server ready {results['startup_s']:.0f} s after start (llm's compiled code "
              f"{'loaded from the cache' if results['compile_cache_warm'] else 'compiled on this start'}).",
              "", "Building a new grammar (structured outputs, on the submitting thread, never the engine's): "
              + ", ".join(f"{name.replace('_', ' ')} {ms:.1f} ms" for name, ms in results["grammar_build_ms"].items()) + "."]
    g = results["grammar_stall"]
    lines += ["", f"Grammar builds beside decoding rows ({g['streams']} free streams, a constrained request every "
              f"{g['every_s']:g} s): the free rows' inter-token p99 {g['cached_p99_ms']:.0f} ms with a cached schema, "
              f"{g['fresh_p99_ms']:.0f} ms with a fresh one each time ({g['fresh_schemas']} built): "
              f"{g['p99_ratio']:.2f}x (goal: at most 1.5x)."]
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
        fig, (tput, lat, first) = plt.subplots(1, 3, figsize=(17, 4.8))
        for system in ORDER:
            rows = sorted((p for p in points if p["system"] == system and p["workload"] == name), key=lambda p: p["concurrency"])
            if rows:
                tput.plot([p["concurrency"] for p in rows], [p["tokens_per_s"] for p in rows], marker="o", label=system)
                lat.plot([p["tokens_per_s"] for p in rows], [p["p50_ms"] for p in rows], marker="o", label=system)
                first.plot([p["concurrency"] for p in rows], [p["ttft_p50_ms"] for p in rows], marker="o", label=system)
        rows = sorted({p["concurrency"]: p["roofline_tokens_per_s"] for p in points
                       if p["workload"] == name and p["system"] == OURS}.items())
        tput.plot([c for c, _ in rows], [v for _, v in rows], "k--", label=f"roofline ({engine(results)})")
        tput.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="output tokens/s", title=f"{name}: throughput")
        lat.set(yscale="log", xlabel="output tokens/s", ylabel="p50 latency (ms)", title=f"{name}: latency vs throughput")
        first.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="p50 time to first token (ms)",
                  title=f"{name}: time to first token")
        for ax in (tput, lat, first):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / f"{name}.png", dpi=110)
        plt.close(fig)


def write(results: dict, out: Path) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown(results))
    plots(results, out)
