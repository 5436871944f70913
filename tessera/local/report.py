"""The load report: the benchmark contract's metrics over client-side measurements, a table, plots.

Metric definitions are the simulator's (``tessera.core.slo``), applied to the finished requests.
A request that failed (HTTP error, stream cut) or did not finish counts as an SLO miss in
``slo_attainment`` and ``slo_attainment_by_class`` (nothing sent is left out silently); ``failed``
counts them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from tessera.core.slo import mean_itl, slo_met, summarize, ttft
from tessera.local.load import Outcome


def summarize_outcomes(outcomes: Sequence[Outcome], wall_s: float) -> dict[str, Any]:
    """Contract metrics (finished requests) plus SLO attainment over every request sent, by class."""
    finished = [o.request for o in outcomes if o.ok]
    out: dict[str, Any] = summarize(finished, wall_s=wall_s) if finished else {"wall_s": wall_s}
    out["requests"] = len(outcomes)
    out["finished"] = len(finished)
    out["failed"] = len(outcomes) - len(finished)
    out["output_tokens"] = sum(r.generated for r in finished)
    verdicts: dict[str, list[bool]] = defaultdict(list)
    for o in outcomes:
        met = slo_met(o.request) if o.ok else False
        if met is not None:
            verdicts[o.item.class_name].append(met)
    if verdicts:
        every = [m for ms in verdicts.values() for m in ms]
        out["slo_attainment"] = sum(every) / len(every)
        out["slo_attainment_by_class"] = {c: sum(v) / len(v) for c, v in sorted(verdicts.items())}
    else:
        out.pop("slo_attainment", None)
        out.pop("slo_attainment_by_class", None)
    out["by_class"] = class_rows(outcomes)
    errors = [o.error for o in outcomes if o.error]
    if errors:
        out["first_error"] = errors[0]
    return out


def class_rows(outcomes: Sequence[Outcome]) -> dict[str, dict[str, Any]]:
    """Per class: requests, finished, TTFT (mean, p99), mean ITL and SLO attainment."""
    groups: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        groups[o.item.class_name].append(o)
    rows: dict[str, dict[str, Any]] = {}
    for name, group in sorted(groups.items()):
        done = [o.request for o in group if o.ok]
        ttfts = np.array([ttft(r) for r in done]) if done else np.array([])
        itls = [x for x in (mean_itl(r) for r in done) if x is not None]
        verdicts = [(slo_met(o.request) if o.ok else False) for o in group]
        judged = [v for v in verdicts if v is not None]
        rows[name] = {
            "kind": group[0].request.service_class.kind,
            "requests": len(group),
            "finished": len(done),
            "mean_ttft_s": float(ttfts.mean()) if done else None,
            "p99_ttft_s": float(np.percentile(ttfts, 99)) if done else None,
            "mean_itl_s": float(np.mean(itls)) if itls else None,
            "slo_attainment": sum(judged) / len(judged) if judged else None,
        }
    return rows


def _fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}{unit}"
    return f"{value}{unit}"


def render_report(summary: dict[str, Any]) -> str:
    """The report as plain text (a table by class, then the totals)."""
    header = f"{'class':<14}{'kind':<13}{'requests':>9}{'finished':>9}{'TTFT mean':>11}{'TTFT p99':>10}"
    header += f"{'ITL mean':>10}{'SLO met':>9}"
    lines = [header, "-" * len(header)]
    for name, row in summary.get("by_class", {}).items():
        slo = row["slo_attainment"]
        lines.append(
            f"{name:<14}{row['kind']:<13}{row['requests']:>9}{row['finished']:>9}"
            f"{_fmt(row['mean_ttft_s'], 's'):>11}{_fmt(row['p99_ttft_s'], 's'):>10}"
            f"{_fmt(row['mean_itl_s'], 's'):>10}{('-' if slo is None else f'{slo:.1%}'):>9}"
        )
    lines.append("-" * len(header))
    total = summary.get("slo_attainment")
    lines.append(
        f"requests {summary['requests']}, finished {summary['finished']}, failed {summary['failed']}, "
        f"SLO attainment {'-' if total is None else f'{total:.1%}'}, "
        f"throughput {_fmt(summary.get('throughput_rps'), ' req/s')}, "
        f"output {_fmt(summary.get('output_tokens_per_s'), ' tok/s')}, wall {summary['wall_s']:.1f} s"
    )
    if summary.get("first_error"):
        lines.append(f"first error: {summary['first_error']}")
    return "\n".join(lines)


def write_plots(outcomes: Sequence[Outcome], directory: Path) -> list[Path]:
    """PNG plots: TTFT CDF by class, and requests sent / finished over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    fig, ax = plt.subplots(figsize=(6, 4))
    groups: dict[str, list[float]] = defaultdict(list)
    for o in outcomes:
        if o.ok:
            groups[o.item.class_name].append(ttft(o.request))
    for name, values in sorted(groups.items()):
        xs = np.sort(values)
        ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post", label=name)
    ax.set_xlabel("time to first token (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("TTFT CDF by class (client-side)")
    ax.legend()
    paths.append(directory / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    sent = np.sort([o.request.arrival for o in outcomes])
    done = np.sort([o.request.finished_at for o in outcomes if o.ok and o.request.finished_at is not None])
    ax.plot(sent, np.arange(1, len(sent) + 1), label="sent")
    if len(done):
        ax.plot(done, np.arange(1, len(done) + 1), label="finished")
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("requests")
    ax.set_title("Requests over time (gap = in the system)")
    ax.legend()
    paths.append(directory / "requests_over_time.png")
    fig.savefig(paths[-1], dpi=100, bbox_inches="tight")
    plt.close(fig)
    return paths


def render_comparison(summaries: dict[str, dict[str, Any]], title: str = "same load, policy") -> str:
    """The reports of runs of the same load (under different policies, or beside other work), side by
    side (one column each, named by its key)."""
    names = list(summaries)
    first = summaries[names[0]]
    label_width = 30
    header = f"{title:<{label_width}}" + "".join(f"{n:>12}" for n in names)
    lines = [header, "-" * len(header)]

    def row(label: str, values: list[Any], unit: str = "", share: bool = False) -> None:
        cells = ["-" if v is None else (f"{v:.1%}" if share else f"{v:.2f}{unit}") for v in values]
        lines.append(f"{label:<{label_width}}" + "".join(f"{c:>12}" for c in cells))

    for cls, info in first.get("by_class", {}).items():
        rows = [s.get("by_class", {}).get(cls, {}) for s in summaries.values()]
        tag = f"{cls} ({info['kind']})"
        row(f"{tag} TTFT p99", [r.get("p99_ttft_s") for r in rows], " s")
        row(f"{tag} TTFT mean", [r.get("mean_ttft_s") for r in rows], " s")
        row(f"{tag} SLO met", [r.get("slo_attainment") for r in rows], share=True)
    row("all SLO met", [s.get("slo_attainment") for s in summaries.values()], share=True)
    row("output tokens/s", [s.get("output_tokens_per_s") for s in summaries.values()])
    counts = [f"{s['finished']}/{s['requests']}" for s in summaries.values()]
    lines.append(f"{'finished/sent':<{label_width}}" + "".join(f"{c:>12}" for c in counts))
    return "\n".join(lines)


def render_answers(outcomes: Sequence[Outcome], count: int, width: int = 300) -> str:
    """A few answers to text prompts: interactive classes first, answers the model ended itself first."""
    answered = [o for o in outcomes if o.ok and o.item.prompt_text is not None and o.answer.strip()]
    answered.sort(key=lambda o: (o.request.service_class.kind != "interactive", o.finish != "stop",
                                 o.item.index))  # fmt: skip
    if not answered:
        return "no answers to show (the trace has no prompt text, or no request finished)"
    lines = [f"{min(count, len(answered))} of the answers (greedy, as the model wrote them):"]
    for o in answered[:count]:
        text = " ".join(o.answer.split())
        more = "..." if len(text) > width else ""
        cut = "" if o.finish == "stop" else f" [cut at {o.request.generated} tokens]"
        pad = " " * (len(o.item.class_name) + 2)
        lines.append(f"  [{o.item.class_name}] Q: {' '.join((o.item.prompt_text or '').split())[:width]}")
        lines.append(f"  {pad} A: {text[:width]}{more}{cut}")
    return "\n".join(lines)


def render_same_prompts(outcomes: Sequence[Outcome], wall_s: float, width: int = 300) -> str:
    """The answers of several models to the same prompts (``same_prompts``), grouped by prompt in the
    order sent: each model's answer (or its error) under the question."""
    if not outcomes:
        return "no text prompt of an interactive class to ask the models"
    models = list(dict.fromkeys(o.item.model for o in outcomes))
    pad = max(len(m) for m in models)
    lines = [f"the same prompts to {', '.join(models)} (greedy, at once; {wall_s:.1f} s):"]
    asked: list[str] = []
    for o in outcomes:
        question = " ".join((o.item.prompt_text or "").split())
        if not asked or asked[-1] != question:
            asked.append(question)
            lines.append(f"  Q: {question[:width]}")
        if o.error is not None:
            lines.append(f"    {o.item.model:<{pad}}  failed: {o.error}")
            continue
        text = " ".join(o.answer.split())
        more = "..." if len(text) > width else ""
        cut = "" if o.finish == "stop" else f" [cut at {o.request.generated} tokens]"
        lines.append(f"    {o.item.model:<{pad}}  A: {text[:width]}{more}{cut}")
    return "\n".join(lines)


def write_comparison_plot(outcomes: dict[str, Sequence[Outcome]], directory: Path) -> Path:
    """One PNG: the TTFT CDF of each class (one panel each), one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = sorted({o.item.class_name for runs in outcomes.values() for o in runs})
    fig, axes = plt.subplots(1, len(classes), figsize=(5 * len(classes), 4), squeeze=False)
    for ax, cls in zip(axes[0], classes, strict=True):
        for policy, runs in outcomes.items():
            values = np.sort([ttft(o.request) for o in runs if o.ok and o.item.class_name == cls])
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=policy)
        ax.set_xlabel("time to first token (s)")
        ax.set_ylabel("share of requests")
        ax.set_title(f"class {cls}: TTFT CDF by policy")
        ax.legend()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "ttft_by_policy.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path
