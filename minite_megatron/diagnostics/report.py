"""Divergence reports: markdown, JSON and a PNG plot of a :class:`~.compare.Comparison`.

:func:`write_report` writes three files into a folder:

- ``report.md``: the verdict (first divergence, with the worst element; whether it was
  absorbed or changed codes, scales or routing downstream; the first *consequential*
  divergence, :func:`~.compare.rank_by_consequence`), counts, the divergences ranked by
  consequence, a per-layer summary and a table of every point in execution order (experts of
  one layer collapsed into one row: ``local_experts.*``), both divergences in bold;
- ``report.json``: :meth:`Comparison.to_dict` (every point, uncollapsed);
- ``report.png``: top, a heatmap of log10(max |error|) per layer (columns) and capture point
  (rows), bitwise-equal cells in light grey, the first divergence outlined in red; bottom, the
  max |error| of every point in execution order, with the first divergence marked (red) and the
  first consequential one (orange) where they differ.

matplotlib runs with the Agg backend (no display needed).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .compare import Comparison, PointResult, rank_by_consequence

_EXACT_COLOR = "#3b6fb6"
_STATUS_RANK = {"diverged": 5, "within_tol": 4, "equal": 3, "no_common_rows": 2, "missing_in_other": 1, "missing_in_ref": 0}


@dataclass
class GroupRow:
    """Points of one layer sharing a label (experts collapsed), aggregated for the table."""

    index: int
    label: str
    layer: int | None
    names: list[str]
    status: str
    max_abs: float
    max_rel: float
    mismatched: int
    elements: int
    rows_common: int
    routing_mismatch_tokens: int
    first_bad: str | None
    is_first_divergence: bool
    numeric: bool = True
    is_first_consequential: bool = False


def group_results(cmp: Comparison) -> list[GroupRow]:
    """Aggregate point results by (layer, label), keeping the execution order of the first member."""
    groups: dict[tuple, list[PointResult]] = {}
    for r in cmp.results:
        groups.setdefault((r.layer, r.label), []).append(r)
    first = cmp.first_divergence.name if cmp.first_divergence else None
    consequential = cmp.first_consequential.name if cmp.first_consequential else None
    rows = []
    for (layer, label), rs in groups.items():
        worst = max(rs, key=lambda r: _STATUS_RANK[r.status])
        bad = next((r.name for r in rs if r.status == "diverged"), None)
        rows.append(
            GroupRow(
                index=min(r.index for r in rs),
                label=label,
                layer=layer,
                names=[r.name for r in rs],
                status=worst.status,
                max_abs=_nanmax(r.max_abs for r in rs),
                max_rel=_nanmax(r.max_rel for r in rs),
                mismatched=sum(r.mismatched for r in rs),
                elements=sum(r.elements for r in rs),
                rows_common=sum(r.rows_common for r in rs),
                routing_mismatch_tokens=sum(r.routing_mismatch_tokens for r in rs),
                first_bad=bad,
                is_first_divergence=first is not None and first in [r.name for r in rs],
                numeric=all(r.numeric for r in rs),
                is_first_consequential=consequential is not None and consequential in [r.name for r in rs],
            )
        )
    return sorted(rows, key=lambda g: g.index)


def _nanmax(values) -> float:
    """Max ignoring NaN (non-numeric points); NaN if every value is NaN."""
    vals = [v for v in values if not math.isnan(v)]
    return max(vals) if vals else math.nan


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "n/a"
    if v == 0:
        return "0"
    if not math.isfinite(v):
        return str(v)
    return f"{v:.3g}"


def markdown_report(cmp: Comparison) -> str:
    """The markdown text of the report."""
    lines = [f"# Divergence report: {cmp.ref_engine} vs {cmp.other_engine}", ""]
    lines.append(f"Comparison mode: **{cmp.mode}** (reference: `{cmp.ref_engine}`, execution order of the reference).")
    lines.append("")
    fd = cmp.first_divergence
    if fd is None:
        lines.append("**No divergence**: every compared point is " + ("bitwise equal." if cmp.mode == "bitwise" else "within tolerance."))
    else:
        lines.append(f"**First divergence: `{fd.name}`** (point #{fd.index}, layer {fd.layer if fd.layer is not None else '-'}).")
        lines.append("")
        if fd.numeric:
            detail = [
                f"- {fd.mismatched} of {fd.elements} elements differ on {fd.rows_common} common rows; "
                f"max |err| {_fmt(fd.max_abs)}, max rel {_fmt(fd.max_rel)}, mean |err| {_fmt(fd.mean_abs)} "
                f"(reference max |value| {_fmt(fd.ref_absmax)})."
            ]
            which = "worst element"
        else:
            detail = [
                f"- {fd.mismatched} of {fd.elements} elements differ on {fd.rows_common} common rows "
                "(integer point: compared exactly)."
            ]
            which = "first differing element"
        if fd.worst_key is not None:
            detail.append(
                f"- {which}: {fd.worst_key}, index {fd.worst_element}: "
                f"{fd.worst_ref!r} ({cmp.ref_engine}) vs {fd.worst_other!r} ({cmp.other_engine})."
            )
        if fd.note:
            detail.append(f"- note: {fd.note}.")
        fc = cmp.first_consequential
        if fd.consequence is not None:
            what = "it is itself a discrete decision" if fd.consequence == fd.name else f"`{fd.consequence}` differs next"
            detail.append(f"- consequence: it changes codes, scales or routing downstream ({what}).")
        elif fd.absorbed_at is not None:
            detail.append(f"- **absorbed**: no code, scale or routing differs before `{fd.absorbed_at}` is bitwise "
                          "equal again.")
        lines += detail
        if fc is not None and fc is not fd:
            lines += [
                "",
                f"**First consequential divergence: `{fc.name}`** (point #{fc.index}, layer "
                f"{fc.layer if fc.layer is not None else '-'}): {fc.mismatched} of {fc.elements} elements differ, "
                f"and `{fc.consequence}` (codes, scales or routing) differs downstream -- the divergence that spreads.",
            ]
        elif fc is None:
            lines += ["", "No divergence changes a code, scale or routing decision downstream (every one is absorbed "
                      "or last)."]
    lines.append("")
    counts = cmp.counts()
    lines.append("Points: " + ", ".join(f"{k} {v}" for k, v in counts.items() if v) + ".")
    lines.append("")

    ranked = rank_by_consequence(cmp)
    if ranked:
        lines += ["## Divergences ranked by consequence", "",
                  "| rank | point | layer | mismatched elements | max abs err | consequence downstream |",
                  "|---:|---|---:|---:|---:|---|"]
        for i, r in enumerate(ranked[:12]):
            if r.consequence is not None:
                fate = "itself discrete" if r.consequence == r.name else f"flips `{r.consequence}`"
            elif r.absorbed_at is not None:
                fate = f"absorbed (equal again at `{r.absorbed_at}`)"
            else:
                fate = "not shown (nothing compared after it)"
            lines.append(f"| {i + 1} | `{r.name}` | {r.layer if r.layer is not None else '-'} | {r.mismatched} | "
                         f"{_fmt(r.max_abs)} | {fate} |")
        if len(ranked) > 12:
            lines.append(f"| | ... {len(ranked) - 12} more | | | | |")
        lines.append("")

    groups = group_results(cmp)
    layers = sorted({g.layer for g in groups if g.layer is not None})
    if layers:
        lines += ["## Per layer", "", "| layer | points | diverged | within tol | equal | max abs err |", "|---:|---:|---:|---:|---:|---:|"]
        for layer in layers:
            rs = [r for r in cmp.results if r.layer == layer]
            lines.append(
                f"| {layer} | {len(rs)} | {sum(r.status == 'diverged' for r in rs)} | "
                f"{sum(r.status == 'within_tol' for r in rs)} | {sum(r.status == 'equal' for r in rs)} | "
                f"{_fmt(_nanmax([0.0] + [r.max_abs for r in rs]))} |"
            )
        lines.append("")

    lines += [
        "## Points in execution order",
        "",
        "| # | point | layer | status | bitwise | common rows | mismatched elements | max abs err | max rel err |",
        "|---:|---|---:|---|:---:|---:|---:|---:|---:|",
    ]
    for g in groups:
        cell = f"`{g.names[0]}`" if len(g.names) == 1 else f"`{g.label}` ({len(g.names)} points)"
        status = g.status + (f" (routing: {g.routing_mismatch_tokens} tokens)" if g.routing_mismatch_tokens else "")
        if g.is_first_divergence or g.is_first_consequential:
            tag = " / ".join(t for t, on in (("first divergence", g.is_first_divergence),
                                               ("first consequential", g.is_first_consequential)) if on)
            cell = f"**{cell} <- {tag}**"
            status = f"**{status}**"
        bitwise = "yes" if g.status == "equal" else ("-" if g.status not in ("diverged", "within_tol") else "no")
        lines.append(
            f"| {g.index} | {cell} | {g.layer if g.layer is not None else '-'} | {status} | {bitwise} | "
            f"{g.rows_common} | {g.mismatched} | {_fmt(g.max_abs)} | {_fmt(g.max_rel)} |"
        )
    lines.append("")
    return "\n".join(lines)


def plot_report(cmp: Comparison, path: str | Path, title: str | None = None) -> Path:
    """Write the PNG (heatmap by layer x point, and error along execution order)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    path = Path(path)
    groups = group_results(cmp)
    layered = [g for g in groups if g.layer is not None]
    layers = sorted({g.layer for g in layered})
    labels: list[str] = []
    for g in layered:  # row order: first appearance in execution order
        if g.label not in labels:
            labels.append(g.label)

    compared = [r for r in cmp.results if r.compared]
    n_rows = max(len(labels), 1)
    fig_h = 2.6 + 0.32 * n_rows + 2.6
    fig_w = min(24.0, max(8.0, 2.8 + 0.3 * max(len(layers), 1)))  # 94 layers stay readable
    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(fig_w, fig_h), gridspec_kw={"height_ratios": [max(0.32 * n_rows, 1.2), 2.2]}
    )
    fd = cmp.first_divergence

    # Heatmap: log10(max abs err) per (label, layer); NaN = not compared; -inf (bitwise) in grey.
    if layers and labels:
        grid = np.full((len(labels), len(layers)), np.nan)
        equal = np.zeros_like(grid, dtype=bool)
        exact_bad = np.zeros_like(grid, dtype=bool)
        for g in layered:
            i, j = labels.index(g.label), layers.index(g.layer)
            if g.status == "equal":
                equal[i, j] = True
            elif not g.numeric:
                exact_bad[i, j] = g.status == "diverged"
            elif g.status in ("diverged", "within_tol"):
                v = g.max_abs
                grid[i, j] = math.log10(v) if v > 0 and math.isfinite(v) else (np.nan if v == 0 else 40.0)
        finite = grid[np.isfinite(grid)]
        vmin, vmax = (float(finite.min()), float(finite.max())) if finite.size else (-8.0, 0.0)
        if vmax - vmin < 1:
            vmin, vmax = vmin - 0.5, vmax + 0.5
        cmap = matplotlib.colormaps["magma_r"].with_extremes(bad=(0.0, 0.0, 0.0, 0.0))
        ax1.imshow(np.where(equal, 1.0, np.nan), cmap=ListedColormap(["#dcdcdc"]), aspect="auto", vmin=0, vmax=1)
        ax1.imshow(np.where(exact_bad, 1.0, np.nan), cmap=ListedColormap([_EXACT_COLOR]), aspect="auto", vmin=0, vmax=1)
        im = ax1.imshow(grid, cmap=cmap, aspect="auto", vmin=vmin, vmax=vmax)
        ax1.set_yticks(range(len(labels)), labels=labels, fontsize=8)
        step = max(1, len(layers) // 24)
        ax1.set_xticks(range(0, len(layers), step), labels=[str(layers[k]) for k in range(0, len(layers), step)], fontsize=8)
        ax1.set_xlabel("layer")
        cb = fig.colorbar(im, ax=ax1, fraction=0.03, pad=0.01)
        cb.set_label("log10 max |err|", fontsize=8)
        if fd is not None and fd.layer is not None and fd.label in labels:
            i, j = labels.index(fd.label), layers.index(fd.layer)
            ax1.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
        fc = cmp.first_consequential
        if fc is not None and fc is not fd and fc.layer is not None and fc.label in labels:
            i, j = labels.index(fc.label), layers.index(fc.layer)
            ax1.add_patch(Rectangle((j - 0.42, i - 0.42), 0.84, 0.84, fill=False, edgecolor="#e67e22", linewidth=2.5))
        ax1.set_title(
            "max |error| by layer and capture point\n(grey: bitwise equal; blue: integer point (codes, routing) differs; "
            "blank: not compared)",
            fontsize=9,
        )
    else:
        ax1.axis("off")
        ax1.text(0.5, 0.5, "no per-layer capture points", ha="center", va="center")

    # Execution-order curve.
    if compared:
        xs = [r.index for r in compared]
        pos = [r.max_abs for r in compared if r.numeric and r.max_abs > 0 and math.isfinite(r.max_abs)]
        floor = min(pos, default=1e-12) / 10
        top = max(pos, default=1.0) * 10
        # Equal points sit at the floor, integer points that differ at the top (their numeric
        # error means nothing), non-finite errors at the top too.
        ys = []
        for r in compared:
            if r.status == "equal":
                ys.append(floor)
            elif not r.numeric or not math.isfinite(r.max_abs):
                ys.append(top)
            else:
                ys.append(r.max_abs if r.max_abs > 0 else floor)
        colors = [
            "#bbbbbb" if r.status == "equal" else (_EXACT_COLOR if not r.numeric else ("#e69f00" if r.status == "within_tol" else "#c0392b"))
            for r in compared
        ]
        ax2.plot(xs, ys, color="#888888", linewidth=0.8, zorder=1)
        ax2.scatter(xs, ys, c=colors, s=14, zorder=2)
        ax2.set_yscale("log")
        ax2.set_xlabel("capture point (execution order of the reference)")
        ax2.set_ylabel("max |err|\n(equal: bottom, integer: top)", fontsize=9)
        if fd is not None:
            ax2.axvline(fd.index, color="red", linestyle="--", linewidth=1)
            ax2.annotate(
                f"first divergence:\n{fd.name}",
                xy=(fd.index, ys[xs.index(fd.index)]),
                xytext=(0.02, 0.95),
                textcoords="axes fraction",
                fontsize=8,
                va="top",
                color="red",
                bbox={"boxstyle": "round", "fc": "white", "ec": "none", "alpha": 0.85},
                arrowprops={"arrowstyle": "->", "color": "red", "linewidth": 0.8},
            )
        fc = cmp.first_consequential
        if fc is not None and fc is not fd and fc.index in xs:
            ax2.axvline(fc.index, color="#e67e22", linestyle="--", linewidth=1)
            ax2.annotate(f"first consequential:\n{fc.name}", xy=(fc.index, ys[xs.index(fc.index)]),
                         xytext=(0.55, 0.95), textcoords="axes fraction", fontsize=8, va="top", color="#e67e22",
                         bbox={"boxstyle": "round", "fc": "white", "ec": "none", "alpha": 0.85},
                         arrowprops={"arrowstyle": "->", "color": "#e67e22", "linewidth": 0.8})
        ax2.grid(True, which="major", alpha=0.3)
    else:
        ax2.axis("off")
        ax2.text(0.5, 0.5, "no point compared", ha="center", va="center")

    fig.suptitle(title or f"{cmp.ref_engine} vs {cmp.other_engine} ({cmp.mode})", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_position_curves(curves: dict, path: str | Path, title: str = "learner vs rollout log-prob gap by position") -> Path:
    """PNG of :func:`~.metrics.position_curves`: mean and max |dlogp| per position (log scale;
    exact zeros drawn at the floor) and the fraction of tokens whose log-probs differ."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    cnt = curves["count"].numpy()
    x = np.arange(cnt.size)
    valid = cnt > 0
    mean, mx = curves["logprob_abs_diff_mean"].numpy(), curves["logprob_abs_diff_max"].numpy()
    pos = np.concatenate([mean[valid & (mean > 0)], mx[valid & (mx > 0)]])
    floor = pos.min() / 10 if pos.size else 1e-12
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [2.2, 1]})
    a1.plot(x[valid], np.maximum(mx[valid], floor), label="max |dlogp|", color="#c0392b", linewidth=1)
    a1.plot(x[valid], np.maximum(mean[valid], floor), label="mean |dlogp|", color="#2c7fb8", linewidth=1)
    a1.set_yscale("log")
    a1.set_ylabel("|dlogp| (0 at the floor)")
    a1.legend(fontsize=8)
    a1.grid(True, alpha=0.3)
    a2.plot(x[valid], curves["mismatch_frac"].numpy()[valid], color="#444444", linewidth=1)
    a2.set_ylabel("frac tokens\nnot equal", fontsize=9)
    a2.set_xlabel("position (column of the [B, T] layout)")
    a2.set_ylim(-0.02, 1.02)
    a2.grid(True, alpha=0.3)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(cmp: Comparison, out_dir: str | Path, stem: str = "report") -> dict[str, Path]:
    """Write ``{stem}.md``, ``{stem}.json`` and ``{stem}.png`` into ``out_dir``; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md = out / f"{stem}.md"
    md.write_text(markdown_report(cmp))
    js = out / f"{stem}.json"
    js.write_text(json.dumps(cmp.to_dict(), indent=1))
    png = plot_report(cmp, out / f"{stem}.png")
    return {"markdown": md, "json": js, "png": png}


__all__ = ["GroupRow", "group_results", "markdown_report", "plot_position_curves", "plot_report", "write_report"]
