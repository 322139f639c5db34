"""Charts the notebooks show: where memory goes, per placement route."""

from __future__ import annotations

from .cards import SIMULATED_CARDS_GB
from .errors import InvalidChoiceError, require_choice
from .quantization import QUANTS

ROUTE_NAMES = {
    "ple-gpu": 'ple="gpu"\n{"": 0}',
    "ple-cpu": 'ple="cpu"\nCPU lookup',
    "post-load": '{"": 0}, then\noffload_ple',
    "cpu-entry": '"cpu" entry,\nhook left on',
}


def route_memory(records: dict, ax=None):
    """Grouped bars: allocated after load, reserved, peak during load and peak during prefill."""
    import matplotlib.pyplot as plt
    import numpy as np

    routes = [r for r in ROUTE_NAMES if (records.get(r) or {}).get("resident_bytes") is not None]
    series = {
        "allocated after load": [records[r]["resident_bytes"] for r in routes],
        "reserved after load": [records[r]["reserved_bytes"] for r in routes],
        "peak during load": [records[r]["peak_load_bytes"] for r in routes],
        "peak during prefill": [next((p.get("peak_bytes", 0) for p in records[r].get("prefill", [])), 0) for r in routes],
    }
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    x = np.arange(len(routes))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        bars = ax.bar(x + i * width, [v / 1e9 for v in values], width, label=label)
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    contexts = [next((p["context"] for p in records[r].get("prefill", [])), None) for r in routes]
    labels = [ROUTE_NAMES[r] + (f"\n(prefill: {c:,} tokens)" if c else "") for r, c in zip(routes, contexts)]
    ax.set_xticks(x + width * (len(series) - 1) / 2, labels, fontsize=8)
    ax.set_ylabel("GB on the GPU")
    any_record = records[routes[0]]
    ax.set_title(f"{any_record['model']} {any_record['quant']} on {any_record['gpu']} (recorded {any_record['date']})")
    ax.legend(fontsize=8)
    return ax


def weights_by_part(estimates: dict, ax=None, card_gb=SIMULATED_CARDS_GB):
    """Stacked bars of GPU weight bytes per course part, one bar per configuration, with card sizes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 4))
    labels = list(estimates)
    parts = sorted({p for e in estimates.values() for p in e.by_course_part()})
    bottoms = [0.0] * len(labels)
    for part in parts:
        heights = [estimates[label].by_course_part().get(part, 0) / 1e9 for label in labels]
        ax.bar(labels, heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    for x, total in enumerate(bottoms):
        ax.text(x, total + 0.2, f"{total:.1f}", ha="center", fontsize=8)
    for gb in card_gb:
        ax.axhline(gb, color="grey", linestyle=":", linewidth=1)
        ax.text(len(labels) - 0.5, gb, f"{gb} GB card", fontsize=7, va="bottom", ha="right", color="grey")
    ax.set_ylabel("GB of weights on the GPU")
    ax.legend(fontsize=8, loc="upper right", bbox_to_anchor=(1.0, 0.9))
    return ax


def parameter_budget(bytes_by_part: dict, title: str, ax=None):
    """Horizontal bars: where the bytes of a model go, largest first, with each part's share."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    parts = sorted(bytes_by_part, key=bytes_by_part.get)
    total = sum(bytes_by_part.values())
    bars = ax.barh(parts, [bytes_by_part[p] / 1e9 for p in parts], color="tab:blue")
    ax.bar_label(bars, labels=[f"{bytes_by_part[p] / 1e9:.2f} GB ({bytes_by_part[p] / total:.0%})" for p in parts], fontsize=8)
    ax.set_xlabel("GB in bf16")
    ax.set_title(title)
    ax.set_xlim(0, max(bytes_by_part.values()) / 1e9 * 1.35)
    return ax


def peak_vs_context(records: list, ax=None, planner=None, quants: tuple | None = None):
    """Peak GPU memory against prefill length, one line per model, quantization and placement
    (the benchmark's memory preset), only ``quants`` where given; dashed: the planner's prediction where
    ``planner`` is given (a function (model, quant, ple, context) -> bytes)."""
    import matplotlib.pyplot as plt

    if quants is not None:
        if not isinstance(quants, (tuple, list)):
            raise InvalidChoiceError(f"quants={quants!r} is not a tuple of quantizations; pass e.g. quants=('nf4', 'bf16').")
        for quant in quants:
            require_choice(quant, QUANTS, "quants")
    if ax is None:
        _, ax = plt.subplots(figsize=(9, 5))
    colors = {}
    for record in sorted(records, key=lambda r: (r["configuration"]["model"], r["configuration"]["quant"], r["configuration"]["ple"])):
        c = record["configuration"]
        points = [p for p in record.get("prefill", []) if "peak_bytes" in p]
        if not points or (quants is not None and c["quant"] not in quants):
            continue
        label = f"{c['model']} {c['quant']}, PLE on {c['ple']}"
        x = [p["context"] for p in points]
        line, = ax.plot(x, [p["peak_bytes"] / 1e9 for p in points], "-", marker="o" if c["ple"] == "cpu" else "s",
                        markersize=4, label=label, color=colors.get((c["model"], c["quant"])), alpha=0.55, linewidth=2.5,
                        zorder=2, gid="measured")
        colors[(c["model"], c["quant"])] = line.get_color()
        if planner is not None:
            # on top of the measured line, thin and dark-edged, so it shows where the two agree (which is most places)
            ax.plot(x, [planner(c["model"], c["quant"], c["ple"], n) / 1e9 for n in x], linestyle=(0, (1, 1.5)),
                    color=line.get_color(), linewidth=1.6, zorder=3, path_effects=[_outline()], gid="planner")
    for card in SIMULATED_CARDS_GB:
        ax.axhline(card, color="grey", linewidth=0.6, linestyle="--")
        ax.text(0.01, card, f"{card} GB card", transform=ax.get_yaxis_transform(), fontsize=7, color="grey", va="bottom")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prefill length (tokens)")
    ax.set_ylabel("peak GPU memory (GB)")
    any_record = records[0]
    ax.set_title(f"Peak memory vs context on {any_record['gpu']} (recorded {any_record['date']})", fontsize=10)
    handles, labels = ax.get_legend_handles_labels()
    if planner is not None:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], color="black", linestyle=(0, (1, 1.5)), linewidth=1.6))
        labels.append("planner's prediction (dotted, same colour)")
    ax.legend(handles, labels, fontsize=7, ncol=2)
    return ax


def _outline():
    from matplotlib import patheffects

    return patheffects.withStroke(linewidth=2.8, foreground="white")


def card_fits(records: list, ax=None, planner=None):
    """Largest context that prefills and decodes on each simulated card, per model and placement
    (the benchmark's cards preset); "does not load" where the model does not. ``planner``: a function
    (model, quant, ple, card_gb) -> predicted largest context, drawn as a tick."""
    import matplotlib.pyplot as plt
    import numpy as np

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 5.5))
    rows = sorted(records, key=lambda r: (r["configuration"]["model"], r["configuration"]["card_gb"], r["configuration"]["ple"]),
                  reverse=True)
    labels = [f"{r['configuration']['model']}, {r['configuration']['card_gb']:g} GB, PLE on {r['configuration']['ple']}" for r in rows]
    values = [r.get("max_context") or 0 for r in rows]
    y = np.arange(len(rows))
    bars = ax.barh(y, values, height=0.55, color=["tab:orange" if r["configuration"]["ple"] == "gpu" else "tab:blue" for r in rows])
    ax.bar_label(bars, labels=[f"{v:,}" if v else "does not load" for v in values], fontsize=7, padding=3)
    if planner is not None:
        predicted = [planner(r["configuration"]["model"], r["configuration"]["quant"], r["configuration"]["ple"],
                             r["configuration"]["card_gb"]) for r in rows]
        shown = [(value, row) for value, row in zip(predicted, y) if value]  # "does not load" has nothing to mark
        # a small triangle above each bar, in the gap between bars, where no value label sits
        ax.scatter([v for v, _ in shown], [row + 0.4 for _, row in shown], marker="v", s=28, color="black",
                   label="planner's expected largest context", zorder=3)
        ax.legend(fontsize=8, loc="lower right")
    ax.set_yticks(y, labels, fontsize=8)
    ax.set_xlabel("largest prompt that prefills and decodes (tokens)")
    ax.set_xlim(0, max(values) * 1.2)
    ax.set_title("What fits on which card (orange: PLE on GPU, blue: PLE on CPU)", fontsize=10)
    return ax


def peak_against_context_paths(predicted: dict, measured: dict, ax=None, card_gb=SIMULATED_CARDS_GB):
    """Peak GB against context for a chunked prefill, one line per path: the planner's prediction (dotted) and
    the benchmark's measurement where there is one (solid); the learners' cards as grey lines.
    ``predicted``/``measured``: path -> {context: bytes}."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    for path, points in predicted.items():
        line, = ax.plot(list(points), [v / 1e9 for v in points.values()], linestyle=":", marker=".",
                        label=f"{path}: planner")
        if measured.get(path):
            ax.plot(list(measured[path]), [v / 1e9 for v in measured[path].values()], color=line.get_color(),
                    marker="o", label=f"{path}: measured")
    for gb in card_gb:
        ax.axhline(gb, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{gb:g} GB card", (1, gb), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                    textcoords="offset points", ha="right", fontsize=8, color="grey")
    contexts = sorted({n for points in predicted.values() for n in points})
    ax.set_xscale("log", base=2)
    ax.set_xticks(contexts, [f"{n // 1024}k" for n in contexts])
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak GB allocated on the GPU")
    ax.set_title("A long prompt prefilled in chunks: plain and tuned", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    return ax


def decode_speeds(records: dict, ax=None):
    """Tokens/s of each decode mode of one benchmark run (name -> record), as bars, and in the title the
    bandwidth limit the same run measured (far off the scale): how far each mode is from what the GPU's
    memory could feed."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3))
    timed = {name: r["decode_tokens_per_s"] for name, r in records.items() if r.get("decode_tokens_per_s")}
    bars = ax.barh(list(timed), list(timed.values()), color="tab:blue")
    ax.bar_label(bars, fmt="%.1f", padding=3, fontsize=8)
    limits = [r["bandwidth_limit_tokens_per_s"] for r in records.values() if r.get("bandwidth_limit_tokens_per_s")]
    if limits:
        gpu = next((r["gpu"] for r in records.values() if r.get("gpu")), "the recorded GPU")
        ax.set_title(f"bandwidth limit of the {gpu} the run recorded: {min(limits):,.0f} tokens/s (off the scale)", fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("decode tokens/s, batch 1")
    return ax


def training_memory(estimates: dict, ax=None, card_gb=SIMULATED_CARDS_GB, measured: dict | None = None):
    """Stacked bars of one LoRA training step's GPU memory against the sequence length, by kind of term
    (``estimates``: sequence -> ``planner.TrainingEstimate``); ``measured``: sequence -> peak bytes recorded."""
    import matplotlib.pyplot as plt
    import numpy as np

    def kind_of(term: str) -> str:  # each term in exactly one kind, so a bar's top is the step's peak
        if term.startswith("weights"):
            return "weights"
        if "adapter" in term or "gradients (fp32)" in term or term.startswith("optimizer"):
            return "adapters, gradients, optimizer"
        return "logits and the loss" if term.startswith("logits") else "activations (checkpointed, recomputed)"

    kinds = ("weights", "adapters, gradients, optimizer", "activations (checkpointed, recomputed)", "logits and the loss")
    if ax is None:
        _, ax = plt.subplots(figsize=(8, 4))
    sequences = list(estimates)
    x = np.arange(len(sequences))
    bottom = np.zeros(len(sequences))
    for kind in kinds:
        values = np.array([sum(v for t, v in estimates[n].terms.items() if kind_of(t) == kind) / 1e9 for n in sequences])
        ax.bar(x, values, 0.6, bottom=bottom, label=kind)
        bottom += values
    if measured:
        ax.plot([sequences.index(n) for n in measured if n in sequences],
                [measured[n] / 1e9 for n in measured if n in sequences], "ko", label="measured peak")
    for gb in card_gb:
        ax.axhline(gb, color="grey", linestyle=":", linewidth=1)
        ax.annotate(f"{gb:g} GB card", (0, gb), xycoords=("axes fraction", "data"), xytext=(4, 3),
                    textcoords="offset points", fontsize=8, color="grey")
    tops = [*bottom, *(peak / 1e9 for n, peak in (measured or {}).items() if n in sequences), *card_gb]
    ax.set_ylim(0, 1.08 * max(tops))
    ax.set_xticks(x, [f"{n:,}" for n in sequences])
    ax.set_xlabel("tokens per training sequence")
    ax.set_ylabel("GB on the GPU (planner)")
    first = next(iter(estimates.values()))
    ax.set_title(f"One LoRA step of {first.model}, {first.quant}, PLE on {first.ple}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the plot: the card labels stay clear
    return ax


def loss_curves(curves: dict, ax=None):
    """The loss of each training step, one line per run (``curves``: label -> list of losses)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 3.5))
    for label, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, marker=".", label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (cross-entropy)")
    ax.set_title("The copy task", fontsize=10)
    ax.legend(fontsize=8)
    return ax
