"""``bench/run``: every benchmark in one command, one markdown report with PNG plots.

docs/performance.md quotes this report. These machines are shared and noisy,
so no figure here is an absolute timing on its own: every timing is a ratio to, or a
distribution next to, a baseline measured in the same run (the Python and C ceilings for
the hot path, the real kube2iam started in turns on the same node for node start, a bare
watch client for the control process, kube2iam's policy on the same events for STS calls).
The machine's facts are recorded with the figures.

Sections (``--only`` picks some): ``hotpath`` (bench/agent_load.py), ``churn``
(bench/churn.py, API-only), ``node-start`` (bench/node_start.py: kiamfast and the real
kube2iam started in turns on a node whose pods already ask; ``node_start`` is the same),
``scale``
(bench/scale_sim.py), ``runtime`` (bench/churn.py with the runtime, runtime_first_call.py,
runtime_polling.py: the container runtime's path, on a real containerd when root has one),
``kubelet`` (bench/kubelet_timing.py: a real kubelet's podIP delay and new pods' first SDK
call with the runtime view on and off; needs root and tests/k8s/build.sh's binaries),
``fleet`` (bench/fleet_sim.py: many nodes' credential managers against one STS budget),
``kube2iam`` (bench/kube2iam_speed.py: the real kube2iam beside kiamfast in the same run:
hot path on one core, on loopback and through the DNAT, CPU, RSS, workers),
``container-credentials`` (bench/container_credentials.py: the token path beside the same
agent's metadata path, a real kube-apiserver's TokenReview, and a flooding pod's cost to
the others), ``webhook`` (bench/webhook_load.py: the injection webhook's RSS and the API
server's calls under large bodies and slow senders), ``handover`` (bench/handover.py: 30 pods asking through the DNAT during a
surge handover, a rolling restart and a container crash, kube2iam's restart beside; the
socket keeper's memory; the cost of re-asserting the DNAT rule; root only), ``saturated``
(bench/saturated_node.py: a node at full CPU in kubelet-shaped cgroups, v1 and v2, pods
asking as SDKs do; kiamfast at each candidate setting and kube2iam in turn; root only).
A section that fails or cannot run yet (the full agent is missing) says so in the report;
the others still run. ``--quick`` shrinks every section so the whole run takes about two
minutes (for tests; its figures are rough).

    bench/run [--quick] [--out DIR] [--only hotpath,churn,...]

writes ``DIR/report.md`` (default ``bench/report/``), ``DIR/*.png`` and ``DIR/results.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from benchutil import BENCH, ROOT, Unavailable, in_ci, machine_facts, median, summarize_us

SECTIONS = ("hotpath", "churn", "node-start", "scale", "runtime", "kubelet", "fleet", "kube2iam",
            "container-credentials", "webhook", "handover", "saturated", "memory")


@dataclass
class Section:
    title: str
    body: str = ""
    figures: list[str] = field(default_factory=list)
    # (what, value, target, verdict) rows for the report's summary table
    headline: list[tuple[str, str, str, str]] = field(default_factory=list)
    raw: dict = field(default_factory=dict)
    seconds: float = 0.0


# ---- plots -----------------------------------------------------------------------------------

def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


_PCTS = np.array([0, 10, 20, 30, 40, 50, 60, 70, 75, 80, 85, 90, 92.5, 95, 96, 97, 98, 98.5, 99,
                  99.3, 99.5, 99.7, 99.8, 99.9, 99.95, 99.99, 99.999])


def percentile_curve(ax, lat_us: np.ndarray, label: str, **kw) -> None:
    """Latency (ms, log) by percentile on a 'nines' axis: -log10(1 - p)."""
    if lat_us.size == 0:
        return
    pcts = _PCTS[_PCTS <= 100 * (1 - 1 / max(lat_us.size, 2))]
    ys = np.percentile(lat_us, pcts) / 1e3
    xs = -np.log10(1 - pcts / 100)
    ax.plot(xs, ys, label=label, marker=".", **kw)
    ticks = [0, 50, 90, 99, 99.9, 99.99, 99.999]
    ax.set_xticks([-np.log10(1 - t / 100) for t in ticks])
    ax.set_xticklabels([f"{t:g}" for t in ticks])
    ax.set_xlabel("percentile")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)


def plot_hotpath(res, out: Path) -> list[str]:
    import agent_load as al
    plt = _plt()
    names = []
    for mode, title in (("c1", "1 connection, closed loop (rotating over the pod addresses)"),
                        ("paced", f"paced, {res.options['paced_rate']:,.0f} req/s over "
                                  f"{max(res.options['connections'])} connections")):
        kinds = [k for k in al.KINDS if f"{mode}/{k}/agent" in res.latencies]
        if not kinds:
            continue
        fig, axes = plt.subplots(1, len(kinds), figsize=(5 * len(kinds), 4), squeeze=False)
        for ax, kind in zip(axes[0], kinds):
            for srv, style in (("nginx", ":"), ("python", "--"), ("agent", "-")):
                lat = res.latencies.get(f"{mode}/{kind}/{srv}")
                if lat is not None:
                    percentile_curve(ax, lat, al.SERVER_NAMES[srv], linestyle=style)
            ax.axhline(2.0, color="red", linewidth=0.8, alpha=0.6)
            ax.set_title(al.KIND_NAMES[kind], fontsize=10)
            ax.set_ylabel("latency ms")
            ax.legend(fontsize=7)
        fig.suptitle(f"Hot path latency by percentile: {title} (red: 2 ms target)",
                     fontsize=10)
        fig.tight_layout()
        name = f"hotpath_latency_{mode}.png"
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        names.append(name)
    return names


def plot_churn(r, out: Path) -> list[str]:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    lat = r.tally.latencies_us
    percentile_curve(ax1, lat, "credential requests under churn")
    ax1.axhline(1000, color="red", linewidth=0.8, label="SDK budget 1 s")
    ax1.set_ylabel("latency ms")
    ax1.legend(fontsize=8)
    ax1.set_title("latency by percentile", fontsize=10)
    if lat.size:
        bins = np.logspace(np.log10(max(lat.min(), 10) / 1e3), np.log10(lat.max() / 1e3 + 1e-3),
                           80)
        ax2.hist(lat / 1e3, bins=bins, color="tab:blue")
        ax2.set_xscale("log")
        ax2.set_yscale("log")
        ax2.axvline(1000, color="red", linewidth=0.8)
    ax2.set_xlabel("latency ms")
    ax2.set_ylabel("requests")
    ax2.set_title("distribution", fontsize=10)
    fig.suptitle(f"Churn: {r.tally.requests:,} credential requests, {r.replacements:,} pod "
                 f"replacements, {r.tally.wrong} wrong-role answers", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "churn_latency.png", dpi=110)
    plt.close(fig)
    return ["churn_latency.png"]


def plot_scale(f, out: Path) -> list[str]:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["per-node watch", "cluster-wide watch"]
    ax1.bar(labels, [f.node_events, f.wide_events], color=["tab:green", "tab:red"])
    ax1.set_yscale("log")
    ax1.set_ylabel("watch events per agent")
    ax2.bar(["list", "watch"], [f.node_list_bytes / 1e6, f.node_bytes / 1e6], 0.35,
            label="per-node", color="tab:green")
    ax2.bar([0.35, 1.35], [f.wide_list_bytes / 1e6, f.wide_bytes / 1e6], 0.35,
            label="cluster-wide", color="tab:red")
    ax2.set_yscale("log")
    ax2.set_ylabel("MB received per agent")
    ax2.legend(fontsize=8)
    fig.suptitle(f"{f.nodes} nodes × {f.pods_per_node} pods, {f.replacements:,} pods "
                 "replaced", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "scale_watch.png", dpi=110)
    plt.close(fig)
    return ["scale_watch.png"]


# ---- sections --------------------------------------------------------------------------------

def section_hotpath(quick: bool, out: Path, log) -> Section:
    import agent_load as al
    opts = (al.Options(rounds=1, duration=1.0, warmup=0.3, paced_duration=1.0, wrk=False,
                       paced_rate=1000.0)
            if quick else al.Options())
    res = al.run(opts, log=log)
    sec = Section("Hot path: the agent against the Python and C ceilings")
    sec.body = al.markdown(res)
    if res.checks:
        sec.body += "\n\nSet-up checks: " + ", ".join(f"{k}: {v}" for k, v in
                                                     res.checks.items()) + "."
    sec.figures = plot_hotpath(res, out)
    s = al.summarize(res)
    big = max(res.options["connections"])
    g = s.get(("get", big))
    if g:
        sec.headline.append((f"credential GET, {big} connections: throughput × Python ceiling",
                             f"{g['ratio_python']:.2f}", "≥ 0.85",
                             _ok(g["ratio_python"] >= 0.85)))
        sec.headline.append((f"credential GET, {big} connections: CPU efficiency × Python "
                             "ceiling", f"{g['cpu_ratio_python']:.2f}", "≥ 0.85",
                             _ok(g["cpu_ratio_python"] >= 0.85)))
        sec.headline.append(("credential GET: throughput × nginx", f"{g['ratio_nginx']:.2f}",
                             "(C ceiling)", ""))
    for kind in ("get", "put"):
        rs = res.wrk.get(("agent", kind))
        base = res.wrk.get(("python", kind))
        if rs and base:
            ratio = median([x["rps"] / y["rps"] for x, y in zip(rs, base) if y["rps"]])
            sec.headline.append((f"{al.KIND_NAMES[kind]}: throughput × Python ceiling, wrk "
                                 "(C client, saturates the server)", f"{ratio:.2f}", "≥ 0.85",
                                 _ok(ratio >= 0.85)))
    for kind in ("get", "put"):
        p = res.paced.get(("agent", kind))
        if p:
            py, ng = res.paced.get(("python", kind)), res.paced.get(("nginx", kind))
            sec.headline.append((f"{al.KIND_NAMES[kind]}: p99 paced at "
                                 f"{res.options['paced_rate']:,.0f} req/s (Python ceiling, "
                                 "nginx in the same run)",
                                 f"{p.lat['p99']:.2f} ms ({py.lat['p99']:.2f}, "
                                 f"{ng.lat['p99']:.2f})", "< 2 ms",
                                 _latency_ok(p.lat["p99"], ng.lat["p99"])))
    c1 = s.get(("get", 1))
    if c1:
        sec.headline.append(("credential GET, 1 connection: p50 / p99 (Python ceiling's p99)",
                             f"{c1['agent']['p50']:.3f} / {c1['agent']['p99']:.3f} ms "
                             f"({c1['python']['p99']:.3f})",
                             "p99 < 2 ms", _latency_ok(c1["agent"]["p99"],
                                                       c1["nginx"]["p99"])))
    errors = sum(r.errors for runs in res.closed.values() for r in runs) + sum(
        r.errors for r in res.paced.values())
    sec.headline.append(("hot path: wrong or failed answers", str(errors), "0",
                         _ok(errors == 0)))
    sec.raw = {"mode": res.mode, "options": res.options, "checks": res.checks,
               "summary": {f"{k[0]}/c{k[1]}": v for k, v in s.items()},
               "paced": {f"{k[0]}/{k[1]}": v.__dict__ for k, v in res.paced.items()},
               "wrk": {f"{k[0]}/{k[1]}": v for k, v in res.wrk.items()},
               "latency_summary": {k: summarize_us(v) for k, v in res.latencies.items()}}
    return sec


def section_churn(quick: bool, out: Path, log) -> Section:
    import churn
    sec = Section("Correctness under churn: IP reuse while pods hammer the agent")
    runs = ([("main", dict(requests=30_000, rate=20.0, gap=0.01, max_seconds=40))] if quick
            else [("main", dict(requests=1_000_000, rate=50.0, gap=0.01, max_seconds=240)),
                  ("worst", dict(requests=300_000, rate=100.0, gap=0.0, max_seconds=120))])
    parts = []
    for name, kw in runs:
        (r,) = churn.run(log=log, **kw)
        t = r.tally
        if name == "main":
            parts += [churn.markdown([r])]
            sec.figures = plot_churn(r, out)
            sec.headline.append((f"churn: answers naming another pod's role (of "
                                 f"{t.requests:,}; gap {r.gap * 1e3:g} ms)", str(t.wrong),
                                 "0 in ≥ 1,000,000",
                                 _ok(t.wrong == 0 and (quick or t.requests >= 1_000_000))))
            sec.headline.append(("churn: requests not answered 200 within 1 s",
                                 f"{t.late + t.not_served:,} "
                                 f"({(t.late + t.not_served) / max(t.requests, 1):.4%})",
                                 "few", ""))
        else:
            parts += ["", "### Worst case: the new pod asks the instant its IP is published",
                      "", "Same set-up, no gap between the old pod's delete and the new pod's "
                      "IP, twice the replacement rate: the window in which an agent that "
                      "learns pods from a watch can still name the previous pod's role.", "",
                      churn.markdown([r])]
            sec.headline.append((f"churn, worst case (gap 0, {r.rate:g}/s): wrong role "
                                 f"(of {t.requests:,})", str(t.wrong), "0",
                                 _ok(t.wrong == 0)))
        sec.raw[name] = {k: v for k, v in r.__dict__.items() if k != "tally"}
        sec.raw[name]["tally"] = {k: v for k, v in t.__dict__.items()
                                  if k not in ("latencies_us", "first_ok_ms")}
        sec.raw[name]["latency"] = summarize_us(t.latencies_us)
    sec.body = "\n".join(parts)
    return sec


def section_node_start(quick: bool, out: Path, log) -> Section:
    import node_start as ns
    res = ns.run(ns.QUICK if quick else ns.Options(), log=log)
    sec = Section("Node start beside kube2iam: a fresh node whose pods are already asking")
    sec.body = ns.markdown(res)
    sec.headline = ns.headline(res)
    sec.figures = ns.plot(res, out)
    sec.raw = {"options": res.options, "imports": res.imports,
               "runs": [dict(r.__dict__) for r in res.runs]}
    return sec


def section_scale(quick: bool, out: Path, log) -> Section:
    import bench_agent as ba
    import scale_sim as ss
    sec = Section("Scale, simulated against the emulator")
    parts = []
    f = ss.watch_fanout(nodes=20 if quick else 100, pods_per_node=110,
                        replace_fraction=0.1 if quick else 0.3, wide_sample=2 if quick else 4)
    log("  scale: watch fan-out done")
    ratio_ev = f.wide_events / f.node_events if f.node_events else float("nan")
    ratio_b = (f.wide_list_bytes + f.wide_bytes) / (f.node_list_bytes + f.node_bytes)
    parts += [
        f"### Watch fan-out: {f.nodes} nodes × {f.pods_per_node} pods", "",
        f"All {f.nodes} per-node watches and {f.wide_sample} cluster-wide watches (each "
        "receives the same stream: "
        f"{'checked, they agree' if f.wide_agree else 'they DO NOT agree'}) "
        f"while {f.replacements:,} pods were replaced ({f.cluster_events:,} events "
        "cluster-wide: delete, create, IP, Running; the new pod reuses the old one's IP). "
        "Emulator pods are about 0.9 KB of JSON; real ones are several times larger, which "
        "scales the bytes but not the ratios.", "",
        "| per agent | per-node watch (kiamfast, kube2iam --node) | cluster-wide (kube2iam "
        "without --node) | ratio |", "|---|---:|---:|---:|",
        f"| initial list, bytes | {f.node_list_bytes:,.0f} | {f.wide_list_bytes:,.0f} | "
        f"{f.wide_list_bytes / f.node_list_bytes:.0f}× |",
        f"| watch events | {f.node_events:,.1f} (min {f.extra['node_events_min']}, max "
        f"{f.extra['node_events_max']}) | {f.wide_events:,.0f} | {ratio_ev:.0f}× |",
        f"| watch bytes | {f.node_bytes:,.0f} | {f.wide_bytes:,.0f} | "
        f"{f.wide_bytes / f.node_bytes:.0f}× |",
        f"| **whole cluster** ({f.nodes} agents), events delivered | "
        f"{f.node_events_total:,} | {f.wide_events * f.nodes:,.0f} | "
        f"{f.wide_events * f.nodes / max(f.node_events_total, 1):.0f}× |",
        f"| **whole cluster**, bytes (lists + watches) | "
        f"{(f.node_list_bytes + f.node_bytes) * f.nodes / 1e6:,.1f} MB | "
        f"{(f.wide_list_bytes + f.wide_bytes) * f.nodes / 1e6:,.1f} MB | {ratio_b:.0f}× |"]
    sec.figures += plot_scale(f, out)
    sec.headline.append(("scale: watch events per agent, cluster-wide ÷ per-node",
                         f"{ratio_ev:.0f}×", f"≈ nodes ({f.nodes})", ""))
    sec.raw["fanout"] = {k: v for k, v in f.__dict__.items()}

    s = ss.sts_calls_per_hour(hours=1.0 if quick else 6.0, step=120.0 if quick else 60.0,
                              policies=("node-role",) if quick else ("node-role", "pod"))
    log("  scale: STS calls per hour done")
    k2i = s.kube2iam_per_node_hour
    parts += ["", f"### STS calls per hour: {s.nodes:,} nodes × {s.roles} roles", "",
              f"One node simulated for {s.hours:g} h of pod churn ({s.pods} pods, mean life "
              f"1 h, {s.pod_starts} pod starts, roles Zipf-distributed, {s.roles_used} used) "
              "with the real credential manager against moto (calls counted by the proxy), "
              "and kube2iam 0.15's policy on the same events (15 min cache per role per node; "
              "a pod asks at start and every 15 min as botocore refreshes). Nodes are "
              "independent under both, so the cluster rate is the node's × "
              f"{s.nodes:,}.", "",
              "| policy | STS calls / node / h | cluster STS calls / h | × kube2iam | "
              "served with < 15 min left |", "|---|---:|---:|---:|---:|",
              f"| kube2iam 0.15 (15 min cache per role per node) | {k2i:.1f} | "
              f"{k2i * s.nodes:,.0f} | 1.00 | (serves 15–30 min) |"]
    for pol, v in s.kiamfast_per_node_hour.items():
        parts.append(f"| kiamfast `--session-name-policy={pol}` | {v:.1f} | "
                     f"{v * s.nodes:,.0f} | {v / k2i:.2f} | {s.served_short[pol]} |")
    parts += ["", f"Steady state for reference: kube2iam calls STS 4× per role per node per "
              f"hour while the role is in use ({4 * s.roles * s.nodes:,}/h for all "
              f"{s.roles} roles on {s.nodes:,} nodes); kiamfast's node-role sessions last 1 h "
              "and are refreshed at half-life: about 2× per hour."]
    sec.headline.append((f"scale: STS calls/h, {s.nodes:,} nodes (node-role vs kube2iam)",
                         f"{s.kiamfast_per_node_hour['node-role'] * s.nodes:,.0f} vs "
                         f"{k2i * s.nodes:,.0f}",
                         "≤ kube2iam", _ok(s.kiamfast_per_node_hour["node-role"] <= k2i)))
    sec.raw["sts"] = s.__dict__

    floors = ss.floor_rss()
    if ba.full_agent_available():
        foot = [ss.agent_footprint(n, events=1000 if quick else 4000) for n in
                ((110,) if quick else (110, 250))]
        log("  scale: agent footprint done")
        parts += ["", "### The agent's footprint", "",
                  "RSS once ready, and control-process CPU while its node's pods are replaced "
                  "(4 events per replacement, IP reused), against a bare watch client reading "
                  "the same stream (raw HTTP + orjson per event line: the floor for any Python "
                  "watcher) in the same run.", "",
                  "| pods | worker RSS MiB | control RSS MiB | supervisor RSS MiB | events | "
                  "control CPU ms / 1,000 events | bare client ms / 1,000 | ratio | caught up |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in foot:
            parts.append(f"| {r.pods} | {r.rss['worker'] / 2**20:.1f} | "
                         f"{r.rss['control'] / 2**20:.1f} | {r.rss['supervisor'] / 2**20:.1f} | "
                         f"{r.events:,} | {r.control_cpu_per_1k * 1e3:.0f} | "
                         f"{r.floor_cpu_per_1k * 1e3:.1f} | "
                         f"{r.control_cpu_per_1k / r.floor_cpu_per_1k:.0f}× | "
                         f"{'yes' if r.processed else 'NO'} |")
        per_ev, floor_ev = foot[0].control_cpu_per_1k / 1000, foot[0].floor_cpu_per_1k / 1000
        parts += ["", f"Applied to the fan-out run above: the control process of a per-node "
                  f"agent spends about {f.node_events * per_ev * 1e3:,.0f} ms of CPU on its "
                  f"{f.node_events:,.0f} events; a cluster-wide watcher receives "
                  f"{f.wide_events:,.0f} events and spends at least "
                  f"{f.wide_events * floor_ev * 1e3:,.0f} ms only parsing them (the bare "
                  f"client's cost), or about {f.wide_events * per_ev * 1e3:,.0f} ms at the "
                  "control process' cost per event."]
        for r in foot:
            sec.headline.append((f"scale: RSS worker / control at {r.pods} pods",
                                 f"{r.rss['worker'] / 2**20:.0f} / "
                                 f"{r.rss['control'] / 2**20:.0f} MiB", "", ""))
        sec.headline.append(("scale: control CPU per 1,000 events",
                             f"{foot[0].control_cpu_per_1k * 1e3:.0f} ms", "", ""))
        sec.raw["footprint"] = [r.__dict__ for r in foot]
    else:
        parts += ["", "### The agent's footprint", "", "_Not measured: the full agent does not "
                  "run end to end yet (kiamfast.control.process is missing)._"]
    parts += ["", "Interpreter floors (RSS of a bare `python -c` importing the same stacks): " +
              ", ".join(f"{k}: {v / 2**20:.1f} MiB" for k, v in floors.items()) + "."]
    sec.raw["floors"] = floors
    sec.body = "\n".join(parts)
    return sec


def _ok(cond: bool) -> str:
    return "✅" if cond else "❌"


def _latency_ok(p99: float, nginx_p99: float, target: float = 2.0) -> str:
    """A p99 over target is the agent's fault only if nginx met it on the same machine."""
    if p99 < target:
        return "✅"
    if nginx_p99 >= target:
        return f"⚠️ machine-bound: nginx's p99 was {nginx_p99:.2f} ms"
    return "❌"


def section_runtime(quick: bool, out: Path, log) -> Section:
    import churn
    import runtime_first_call as rfc
    import runtime_polling as rpo
    sec = Section("The runtime path (CRI): churn, first call, hot path, polling cost")
    churn_r = churn.run(runtime="auto", slots=8 if quick else 16,
                        requests=30_000 if quick else 1_000_000,
                        min_replacements=10 if quick else 200, log=log)
    first = rfc.run(pods=30 if quick else 200, rounds=1 if quick else 3,
                    round_seconds=3.0 if quick else 8.0, log=log)
    polling = rpo.run(sandboxes=30 if quick else 110, seconds=5.0 if quick else 30.0,
                      log=log)
    sec.body = "\n".join([
        "### Churn: addresses reused at once, the API told late and in the wrong order", "",
        churn.markdown(churn_r), "",
        "### A new pod's first call, and the hot path with and without the runtime", "",
        rfc.markdown(first), "", "### What the runtime polling costs", "",
        rpo.markdown(polling)])
    sec.headline = (churn.headline(churn_r, quick=quick) + rfc.headline(first)
                    + rpo.headline(polling))
    sec.raw = {"churn": [{"mode": r.mode, "runtime": r.runtime, "requests": r.tally.requests,
                          "wrong": r.tally.wrong, "replacements": r.replacements,
                          "reused": r.reused, "latency": summarize_us(r.tally.latencies_us)}
                         for r in churn_r],
               "first_call": {"document_ms": first.first.document_ms.tolist(),
                              "hot_with": first.hot("with"), "hot_without": first.hot("without")},
               "polling": polling.__dict__}
    return sec


def section_kubelet(quick: bool, out: Path, log) -> Section:
    import kubelet_timing as kt
    sec = Section("A real node: the kubelet's podIP delay and a new pod's first SDK call")
    reason = kt.missing_reason()
    if reason:
        raise RuntimeError(reason)
    results = kt.run(pods=4 if quick else 50, batch=4 if quick else 10,
                     scenarios=("idle",) if quick else tuple(kt.SCENARIOS), log=log)
    sec.body = kt.markdown(results)
    sec.headline = kt.headline(results)
    sec.raw = {f"{r.scenario}, {r.mode}": [p.__dict__ for p in r.pods] for r in results}
    return sec


def section_fleet(quick: bool, out: Path, log) -> Section:
    import fleet_sim as fs
    sec = Section("The fleet against STS's account budget (simulated time)")
    results = []
    for name, sc in fs.runs(quick):
        results.append((name, fs.simulate(sc)))
        log(f"  fleet: {name} done")
    sec.body = fs.markdown(results)
    if not quick:      # the per-node cost: a real agent with and without the budget flags
        sec.body += "\n" + fs.footprint_markdown(
            [(name, fs.footprint(flags)) for name, flags in fs.FOOTPRINT_FLAGS.items()])
    for name, r in results:
        if name == "arrival":
            sec.headline.append((
                "fleet arrival: first calls served (the budget allows), peak ÷ budget, "
                "throttled share of calls",
                f"{r['first_call_ok']:,} ({r['first_call_budget_allows']:,}), "
                f"{r['peak_over_budget']:.2f}, {r['throttled_share']:.1%}",
                "all it allows, ≤ 1.1, < 5 %",
                _ok(r["first_call_ok"] >= r["first_call_budget_allows"]
                    and r["peak_over_budget"] <= 1.1 and r["throttled_share"] < 0.05)))
        sec.headline.append((f"fleet, {name}: wrong identity, pods served, lost credentials",
                             f"{r['wrong_identity']}, {r['pods_served']}/{r['pods']}, "
                             f"{r['pods_lost_credentials']}", "0, all, 0",
                             _ok(r["wrong_identity"] == 0 and r["pods_served"] == r["pods"]
                                 and r["pods_lost_credentials"] == 0)))
    sec.raw = {name: r for name, r in results}
    return sec


def section_kube2iam(quick: bool, out: Path, log) -> Section:
    import kube2iam_speed as ks
    res = ks.run(ks.QUICK if quick else ks.Options(), log=log)
    sec = Section("kube2iam beside kiamfast, same run: hot path, CPU, RSS")
    sec.body = ks.markdown(res)
    sec.headline = ks.headline(res)
    sec.raw = {"options": res.options, "identity": res.identity, "rss_mib": res.rss_mib,
               "skipped": res.skipped,
               "paths": {p: {a: [r.__dict__ for r in rs] for a, rs in runs.items()}
                         for p, runs in res.paths.items()},
               "scaling": {k: [r.__dict__ for r in rs] for k, rs in res.scaling.items()}}
    return sec


def section_container_credentials(quick: bool, out: Path, log) -> Section:
    import container_credentials as cc
    res = cc.run(cc.QUICK if quick else cc.Options(), log=log)
    sec = Section("Container credentials: the token path beside the metadata path, and a flood")
    sec.body = cc.markdown(res)
    sec.headline = cc.headline(res)
    sec.raw = {"options": res.options, "load": res.load, "keepalive": res.keepalive,
               "ratios": cc.ratios(res),
               "fresh": {k: summarize_us(np.array(v) * 1e3) for k, v in res.fresh.items()},
               "first_call": summarize_us(np.array(res.first_ms) * 1e3),
               "bare_review": summarize_us(np.array(res.bare_review_ms) * 1e3),
               "phases": {k: {"event": summarize_us(np.array(p.event_ms) * 1e3),
                              "victim": summarize_us(np.array(p.victim_ms) * 1e3),
                              "victim_failed": p.victim_failed, "flood_rps": p.flood_rps,
                              "flood_requests": p.flood_requests, "flood_bad": p.flood_bad,
                              "flood_connects": p.flood_connects,
                              "control_cpu": p.control_cpu}
                          for k, p in res.phases.items()},
               "attacks": {k: a.__dict__ for k, a in res.attacks.items()},
               "churn": res.churn}
    return sec


def section_webhook(quick: bool, out: Path, log) -> Section:
    import webhook_load as wl
    outcomes = wl.run(wl.QUICK if quick else wl.Options(), log=log)
    sec = Section("The injection webhook under hostile clients: memory, and the API server's "
                  "calls")
    sec.body = wl.markdown(outcomes)
    sec.headline = wl.headline(outcomes)
    sec.raw = {o.name: {"peak_rss_mib": o.peak_rss_mib, "idle_rss_mib": o.idle_rss_mib,
                        "api_sent": o.api_sent, "api_answered": o.api_answered,
                        "api_errors": o.api_errors, "attack": o.attack} for o in outcomes}
    return sec


def section_handover(quick: bool, out: Path, log) -> Section:
    import handover as ho
    res = ho.run(ho.QUICK if quick else ho.Options(), log=log)
    sec = Section("Handing the node over: surge, rolling restart, container crash, kube2iam")
    sec.body = ho.markdown(res)
    sec.headline = ho.headline(res)
    sec.raw = {"options": res.options, "scenarios": [s.__dict__ for s in res.scenarios],
               "keeper": res.keeper, "recheck": res.recheck, "skipped": res.skipped}
    return sec


def section_saturated(quick: bool, out: Path, log) -> Section:
    import saturated_node as sn
    res = sn.run(sn.QUICK if quick else sn.Options(), log=log)
    sec = Section("A saturated node: credential calls while the workload takes every CPU")
    sec.body = sn.markdown(res)
    sec.headline = sn.headline(res)
    sec.figures = sn.plot(res, out)
    sec.raw = {"options": res.options, "skipped": res.skipped, "weights": res.weights,
               "outcomes": [{k: v for k, v in o.__dict__.items() if k != "lat_us"}
                            | {"case": o.case.label} for o in res.outcomes]}
    return sec


def section_memory(quick: bool, out: Path, log) -> Section:
    import memory_per_pod as mp
    # quick: a minute of the agent and 20,000 replacements in-process (bench/run --quick runs
    # in CI); the figures of docs/performance.md are the full run's
    minutes, count, warmup = (1.0, 20_000, 20.0) if quick else (10.0, 1_000_000, 60.0)
    agent = mp.run_agent(minutes=minutes, rate=20.0, steady=30, churned=20, runtime="none",
                         every=10.0 if quick else 20.0, warmup=warmup, log=log)
    points = mp.run_inprocess(count, log=log)
    kept = points[-1]
    sec = Section("Memory kept per replaced pod")
    sec.body = (f"The whole agent, pods replaced 20 times a second through the API on 20 "
                f"reused addresses, 30 steady pods asking every 100 ms, PSS of each process:"
                f"\n\n{mp.agent_table(agent)}\n\n{mp.agent_summary(agent, warmup)}\n\n"
                f"The control process's rooms in-process (tracemalloc):\n\n"
                f"{mp.inprocess_table(points)}\n")
    sec.headline = [(f"kept by the control process over {kept.replaced:,} replaced pods",
                     f"{kept.kept_bytes / 2**20:.3f} MiB",
                     "< 1 MiB per 1,000,000",
                     "ok" if kept.kept_bytes * 1_000_000 / kept.replaced < 2**20 else "over"),
                    ("control process memory per replaced pod (agent)",
                     f"{agent.control_bytes_per_pod:+.1f} B", "about 0", "")]
    sec.raw = {"agent": mp.asdict(agent), "inprocess": [mp.asdict(c) for c in points]}
    return sec


RUNNERS = {"hotpath": section_hotpath, "churn": section_churn, "runtime": section_runtime,
           "node-start": section_node_start, "node_start": section_node_start,
           "scale": section_scale, "kubelet": section_kubelet,
           "fleet": section_fleet, "kube2iam": section_kube2iam,
           "container-credentials": section_container_credentials,
           "webhook": section_webhook, "handover": section_handover,
           "saturated": section_saturated, "memory": section_memory}


# ---- the report ------------------------------------------------------------------------------

def _git() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def write_report(out: Path, sections: list[Section], facts: dict, *, quick: bool,
                 seconds: float) -> Path:
    lines = ["# kiamfast benchmark report", "",
             f"Generated by `bench/run{' --quick' if quick else ''}` in {seconds:.0f} s. "
             "Every timing below is a ratio to, or a distribution next to, a baseline measured "
             "in the same run: the machine is shared and noisy, absolute figures are not "
             "comparable between runs." + (" **Quick run: short and rough, for tests.**"
                                          if quick else ""), ""]
    heads = [h for s in sections for h in s.headline]
    if heads:
        lines += ["## Summary", "", "| measure | value | target | |", "|---|---:|---|---|"]
        lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in heads]
        lines.append("")
    for s in sections:
        lines += [f"## {s.title}", "", s.body.strip(), ""]
        for fig in s.figures:
            lines += [f"![{fig}]({fig})", ""]
        lines += [f"_Section time: {s.seconds:.0f} s._", ""]
    lines += ["## Machine", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in facts.items()]
    lines.append("")
    path = out / "report.md"
    path.write_text("\n".join(lines))
    raw = {"facts": facts, "quick": quick, "seconds": seconds,
           "sections": {s.title: s.raw for s in sections}}
    (out / "results.json").write_text(json.dumps(raw, indent=1, default=_jsonable))
    return path


def _jsonable(o):
    if isinstance(o, np.ndarray):
        return f"<array of {o.size}>"
    if isinstance(o, (np.integer, np.floating)):
        return o.item()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if hasattr(o, "__dict__"):
        return o.__dict__
    return str(o)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench/run", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (about 2 minutes)")
    ap.add_argument("--out", default=str(BENCH / "report"), help="output directory")
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections out of {','.join(SECTIONS)}")
    args = ap.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    bad = [s for s in only if s not in RUNNERS]
    if bad:
        ap.error(f"unknown section(s): {', '.join(bad)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.png"):
        old.unlink()
    facts = machine_facts()
    from kiamfast import __version__
    facts["kiamfast"] = f"{__version__} ({_git()})"
    t_all = time.monotonic()

    def log(msg: str) -> None:
        print(f"[{time.monotonic() - t_all:6.1f} s] {msg}", file=sys.stderr, flush=True)

    sections = []
    failed = 0
    for name in only:
        log(f"{name} ...")
        t0 = time.monotonic()
        try:
            sec = RUNNERS[name](args.quick, out, log)
        except Unavailable as e:
            if in_ci():
                failed += 1
            sec = Section(f"{name}: skipped", body=f"Not measured on this machine: {e}.")
            sec.headline.append((f"{name}", f"skipped: {e}", "", "❌" if in_ci() else "—"))
            log(f"{name} skipped: {e}" + (" (CI=true: a failure)" if in_ci() else ""))
        except Exception as e:  # noqa: BLE001 - a broken section must not lose the others
            failed += 1
            log(f"{name} failed: {type(e).__name__}: {e}")
            sec = Section(f"{name}: not measured", body=(
                f"This section failed: `{type(e).__name__}: {e}`\n\n```\n"
                f"{traceback.format_exc()[-3000:]}```"))
            sec.headline.append((f"{name}", "not measured", "", "❌"))
        sec.seconds = time.monotonic() - t0
        sections.append(sec)
        log(f"{name} done in {sec.seconds:.0f} s")
    facts["load average at end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    path = write_report(out, sections, facts, quick=args.quick,
                        seconds=time.monotonic() - t_all)
    log(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
