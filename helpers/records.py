"""The recorded results: every reader of ``data/measurements`` (the benchmark), ``data/gpu-tier`` (the GPU
tier), ``data/gguf`` (the llama.cpp route) and ``data/chat`` (plain-string messages per transformers
release). Reading them needs no GPU; the lab's ``lab.records`` writes them."""

from __future__ import annotations

import importlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidChoiceError, NoRecordError, RecordFileError, require_choice, require_number
from .long_context import positions_written
from .paths import CHAT_DIR, CITED_DIR, GGUF_DIR, GPU_TIER_DIR, MEASUREMENTS_DIR
from .quantization import QUANTS

# the benchmark records' format, written into each (tools/upgrade_records.py brings older ones to it)
SCHEMA = 2
# the contexts the long-context benchmark measures; E4B's max_position_embeddings is the last
LONG_CONTEXTS = (8192, 16384, 32768, 65536, 131072)

class CutRecordNotice(UserWarning):
    """A record file ends in a line a kill cut short: it is skipped, and the next append removes it."""


def record_lines(path: Path) -> list:
    """The JSON records of one ``.jsonl`` file. A last line without its newline that does not parse was cut by a kill
    mid-append: it is skipped, with a notice. Any other line that does not parse is refused in one sentence."""
    text = require_record_file(path).read_text()
    lines = text.split("\n")
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):  # no newline after it: the append was cut short
                warnings.warn(f"{path}: its last line was cut short by a kill mid-append and is skipped; the next "
                              f"record appended removes it.", CutRecordNotice, stacklevel=3)
                continue
            raise RecordFileError(f"{path} line {number} is not a JSON record: restore the file from git "
                                     f"(git checkout -- {Path(path).name}) or delete that line.") from None
    return records


def require_record_file(path) -> Path:
    """``path`` if it is a file, else one sentence: a record the course reads is missing, or a folder stands there."""
    path = Path(path)
    if not path.is_file():
        raise NoRecordError(f"No record file at {path} ({'a folder' if path.is_dir() else 'nothing'} is there): restore "
                            f"it with git checkout -- {path.name}, or run the command that writes it.")
    return path


def require_record_folder(directory) -> Path:
    """``directory`` if it is a folder, else one sentence (a mistyped folder would read as "nothing recorded yet")."""
    directory = Path(directory)
    if not directory.is_dir():
        raise NoRecordError(f"No folder of records at {directory}: pass one of the course's data/ folders (records' "
                            f"defaults), or the folder the benchmark wrote.")
    return directory


def read_json(path) -> dict:
    """A JSON record file, or one sentence where it is missing, cut short or not JSON (a kill mid-write, a hand
    edit)."""
    path = require_record_file(path)
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise RecordFileError(f"{path} is not whole JSON ({error.msg} at line {error.lineno}): restore it with git checkout "
                                 f"-- {path.name}, or run again the command that wrote it.") from None


def require_preset(preset) -> str:
    if not isinstance(preset, str) or not preset.strip():
        raise InvalidChoiceError(f"preset={preset!r} is not a preset's name; pass one such as 'decode-speed' "
                                 f"(python -m lab.bench --help lists them).")
    return preset


def every_record(directory: Path = MEASUREMENTS_DIR, preset: str | None = None):
    """Every benchmark record, in file order (``preset``: that preset's only); the folder and preset are checked
    before the first record is read."""
    if preset is not None:
        require_preset(preset)
    files = sorted(require_record_folder(directory).glob("*.jsonl"))
    return (record for path in files for record in record_lines(path) if not preset or record.get("preset") == preset)


def latest_records(directory: Path = MEASUREMENTS_DIR, preset: str | None = None) -> list:
    """The newest benchmark record of each configuration (records accumulate; reruns supersede)."""
    newest: dict = {}
    for record in every_record(directory, preset):
        c = record["configuration"]
        key = (record.get("preset"), c["model"], c["quant"], c["ple"], c.get("route", ""), c["card_gb"], c.get("name", ""))
        if key not in newest or record["recorded_at"] >= newest[key]["recorded_at"]:
            newest[key] = record
    return list(newest.values())


def require_measured(model: str, directory: Path = MEASUREMENTS_DIR, **fields) -> None:
    """Refuse a ``model`` (or ``quant``) that is neither one of the course's nor named by the benchmark's records: a
    typo would read as "not run yet", where a shape not measured yet reads as that."""
    configurations = [record["configuration"] for record in every_record(directory)]
    course_names = {"model": importlib.import_module(".synthetic", __package__).SHAPES, "quant": QUANTS}
    for what, value in {"model": model, **fields}.items():
        recorded = {c[what] for c in configurations if what in c}
        require_choice(value, sorted(recorded | set(course_names.get(what, ()))), what)


def decode_speeds(model: str = "e4b-shape", quant: str = "nf4", directory: Path = MEASUREMENTS_DIR) -> dict:
    """Decode tokens/s by route (``ple-gpu``, ``ple-cpu``, ``cpu-entry``) from the speed preset, the
    only records timed one process at a time; the memory presets and the GPU tier run side by side."""
    require_measured(model, directory, quant=quant)
    speeds = {}
    for record in latest_records(directory, preset="speed"):
        c = record["configuration"]
        if c["model"] == model and c["quant"] == quant and record.get("decode_tokens_per_s") is not None:
            speeds[c.get("route") or f"ple-{c['ple']}"] = record["decode_tokens_per_s"]
    if not speeds:
        raise NoRecordError(f"No speed records for {model} {quant} in {directory}: run `python -m lab.bench speed` on a GPU.")
    return speeds


def speed_record(model: str = "e4b-shape", route: str = "ple-cpu", quant: str = "nf4", directory: Path = MEASUREMENTS_DIR) -> dict:
    """The speed preset's newest record for one route: load seconds, prefill tokens/s, decode tokens/s."""
    require_measured(model, directory, quant=quant)
    for record in latest_records(directory, preset="speed"):
        c = record["configuration"]
        if c["model"] == model and c["quant"] == quant and (c.get("route") or f"ple-{c['ple']}") == route:
            return record
    raise NoRecordError(f"No speed record for {model} {quant} {route} in {directory}: run `python -m lab.bench speed` on a GPU.")


def decode_rates_over_runs(preset: str, model: str = "e4b-shape", directory: Path = MEASUREMENTS_DIR) -> dict:
    """Every recorded decode tokens/s of each named configuration of a preset, oldest first (name -> list):
    how far a speed moves between runs, where the newest record alone would hide it."""
    require_preset(preset)
    require_measured(model, directory)
    rates: dict = {}
    for record in every_record(directory, preset):
        c = record["configuration"]
        if c["model"] == model and record.get("decode_tokens_per_s"):
            rates.setdefault(c.get("name") or c["ple"], []).append((record["recorded_at"], record["decode_tokens_per_s"]))
    return {name: [rate for _, rate in sorted(runs)] for name, runs in rates.items()}


def preset_records(preset: str, model: str = "e4b-shape", directory: Path = MEASUREMENTS_DIR) -> dict:
    """The newest record of each named configuration of a preset for one model (name -> record); {} when the
    preset has not been run (``make bench PRESET=<preset>`` on a GPU)."""
    require_preset(preset)
    require_measured(model, directory)
    return {r["configuration"].get("name") or r["configuration"]["ple"]: r for r in latest_records(directory, preset=preset)
            if r["configuration"]["model"] == model}


def largest_contexts(model: str = "e4b-shape", directory: Path = MEASUREMENTS_DIR) -> dict:
    """The largest prompt each simulated card prefilled and decoded after (bisected to 512 tokens), NF4 with the PLE
    on the CPU: card GB -> {how it was prefilled: tokens}. ``generate`` in one forward (the cards preset) and the
    chunked paths (``long-context-8gb``, ``long-context-cards``, ``long-context-small-cards``, whose text-only
    route, towers and head off the GPU, is a way of its own); a search that reached ``max_context_limit`` stopped at
    the model's positions, not at the card."""
    require_measured(model, directory)
    reached: dict = {}
    for preset in ("cards", "long-context-8gb", "long-context-cards", "long-context-small-cards"):
        for record in latest_records(directory, preset=preset):
            c = record["configuration"]
            if c["model"] != model or c["quant"] != "nf4" or c["ple"] != "cpu" or c.get("route") not in ("", None, "text-only"):
                continue
            how = ("generate, one prefill" if preset == "cards" else f"{c['path']}, chunks of {c['prefill_chunk']:,}"
                   + (f", {c['allocator']}" if c.get("allocator") else "") + (", text only" if c.get("route") else ""))
            limit = record.get("max_context_limit")
            reached.setdefault(c["card_gb"], {})[how] = (
                record.get("max_context"), bool(limit) and record.get("max_context") == limit)
    return {card: reached[card] for card in sorted(reached)}


def reached_lines(model: str = "e4b-shape", card_gb: float | None = None, path: str | None = None,
                  directory: Path = MEASUREMENTS_DIR) -> list:
    """``largest_contexts`` as sentences, one per card: every way each card was prefilled and how far it got, or
    only ``card_gb``'s, or only the ways on one long-context ``path`` ("plain", "tuned")."""
    if card_gb is not None:
        card_gb = require_number(card_gb, "card_gb", minimum=0)
    if path is not None:
        require_choice(path, ("plain", "tuned"), "path")
    lines = []
    for card, reached in largest_contexts(model, directory).items():
        ways = [f"{how}: {tokens:,}" + (" (the model's limit)" if at_limit else "")
                for how, (tokens, at_limit) in reached.items() if path is None or how.startswith(f"{path},")]
        if ways and card_gb in (None, card):
            lines.append(f"{card:>2g} GB card reached: " + "; ".join(ways))
    return lines


def long_context_peaks(model: str = "e4b-shape", directory: Path = MEASUREMENTS_DIR) -> dict:
    """The long-context preset's measured prefill peaks: path -> {context: bytes}, uncapped ({} before the run)."""
    recorded = preset_records("long-context", model, directory)
    return {path: {p["context"]: p["peak_bytes"] for p in recorded[path].get("prefill", []) if "peak_bytes" in p}
            for path in ("plain", "tuned") if path in recorded}


def _gb(value) -> str:
    return "-" if value is None else f"{value / 1e9:.2f} GB"


def _rate(point: dict) -> str:
    return "-" if point.get("tokens_per_s") is None else f"{point['tokens_per_s']:,.0f}"


def long_context_goal(model: str = "e4b-shape", directory: Path = MEASUREMENTS_DIR) -> list:
    """The long-context goal in sentences, from the long-context preset's newest records: the conversation that
    fills the model's positions on a simulated 8 GB card against the same code uncapped (and its control, where the
    run had one), the plain path on that card, and what each path cost at the longest prompt. [] before the run."""
    recorded = preset_records("long-context", model, directory)
    capped = recorded.get("tuned-128k-8gb")
    if capped is None:
        return []
    c = capped["configuration"]
    check = capped.get("identity") or {}
    if capped.get("crashed") or capped.get("greedy_oom"):
        outcome = capped.get("crashed") or "out of memory"
    else:
        verdict = ("identical to" if check.get("identical") else f"different from step {check.get('first_difference')} of"
                   ) if check.get("compared") else "not compared with"
        outcome = (f"{capped.get('greedy_token_count')} tokens decoded ({capped.get('greedy_distinct_tokens')} distinct), "
                   f"peak {_gb(capped.get('peak_generate_bytes'))} allocated and {_gb(capped.get('peak_generate_reserved_bytes'))} "
                   f"reserved under the {c['card_gb']:g} GB cap; logits {verdict} the same code uncapped"
                   + (f" over {check.get('steps')} self-consistent steps" if check.get("compared") else ""))
    lines = [f"Tuned, {c['card_gb']:g} GB card: a {c['greedy_context']:,}-token prompt in chunks of {c['prefill_chunk']:,} and "
             f"{c['new_tokens']} tokens decoded after it, {positions_written(c['greedy_context'], c['new_tokens']):,} positions written: "
             f"{outcome}."]
    control = next((r for r in recorded.values() if r["configuration"].get("control")), None)
    if control is None:
        lines.append("This run had no deliberately broken control beside that comparison.")
    else:
        told = (control.get("identity") or {}).get("told_apart")
        lines.append(f"Its control, `{control['configuration']['name']}` (one PLE row one bf16 ulp off): "
                     + ("told apart." if told else "NOT told apart: the comparison proves nothing."))
    plain = recorded.get("plain-128k-8gb")
    if plain and plain.get("prefill"):
        point = plain["prefill"][-1]
        lines.append(f"Plain, {plain['configuration']['card_gb']:g} GB card, a {point['context']:,}-token prefill: "
                     + ("out of memory." if point.get("oom") else f"peak {_gb(point.get('peak_bytes'))}."))
    longest = {name: {p["context"]: p for p in recorded.get(name, {}).get("prefill", [])} for name in ("plain", "tuned")}
    shared = sorted(set(longest["plain"]) & set(longest["tuned"]))
    if shared:
        n = shared[-1]
        cost = {name: longest[name][n] for name in ("plain", "tuned")}
        if all("peak_bytes" in point for point in cost.values()):
            described = [f"{name} {_gb(point['peak_bytes'])} allocated, {_gb(point.get('peak_reserved_bytes'))} reserved, "
                         f"{_rate(point)} tokens/s of prefill" for name, point in cost.items()]
            lines.append(f"Uncapped at {n:,} tokens: " + "; ".join(described) + ".")
    return lines


def gpu_tier(model: str = "e4b-shape", quant: str = "nf4", directory: Path = GPU_TIER_DIR) -> dict:
    """The GPU tier's records for a model and quantization, route -> record."""
    path = Path(directory) / f"{model}-{quant}.json"
    if not path.is_file():
        raise NoRecordError(f"No recorded GPU measurements at {path}: run "
                            f"`GPU_RECORD=1 make test-gpu` on a GPU.")
    return read_json(path)


@dataclass(frozen=True)
class RouteRun:
    """One route of the GPU tier's run, its figures by name; None where that route recorded none (a refused load
    records only its ``load_error``)."""

    route: str
    gpu: str
    date: str
    resident_bytes: int | None
    reserved_bytes: int | None
    peak_load_bytes: int | None
    prefill_context: int | None
    prefill_peak_bytes: int | None
    load_error: str | None
    greedy_tokens: int | None
    logits_finite: bool | None


def gpu_route(route: str, model: str = "e4b-shape", quant: str = "nf4", directory: Path = GPU_TIER_DIR) -> RouteRun:
    """What the GPU tier recorded for one route (``ple-cpu``, ``cpu-entry``, ...) of a model and quantization."""
    tier = gpu_tier(model, quant, directory)
    if not isinstance(route, str) or route not in tier:
        raise InvalidChoiceError(f"route={route!r} was not recorded for {model} {quant}; choose one of {', '.join(sorted(tier))}.")
    record = tier[route]
    prefill = (record.get("prefill") or [{}])[0]
    return RouteRun(route, record.get("gpu", "?"), record.get("date", "?"), record.get("resident_bytes"),
                    record.get("reserved_bytes"), record.get("peak_load_bytes"), prefill.get("context"),
                    prefill.get("peak_bytes"), record.get("load_error"), record.get("greedy_token_count"),
                    record.get("logits_finite"))


def gpu_tier_host(model: str = "e4b-shape", quant: str = "nf4", directory: Path = GPU_TIER_DIR) -> dict:
    """Host memory per route (anonymous and file-backed peaks of load and generate), route -> record:
    the GPU tier writes it beside its main record."""
    return gpu_tier_file(f"host-{model}-{quant}.json", directory)


def gpu_tier_file(name: str, directory: Path = GPU_TIER_DIR) -> dict:
    """Any other record the GPU tier keeps, by file name (e.g. ``determinism-e4b-shape.json``)."""
    path = Path(directory) / name
    if not path.is_file():
        raise NoRecordError(f"No GPU record {path}: it is written by a GPU run (see the "
                            f"GPU tier in docs/results.md).")
    return read_json(path)


def fine_tuning_records(directory: Path = GPU_TIER_DIR) -> list:
    """The GPU tier's fine-tuning records (``tools/fine_tuning_bench.py``), in name order."""
    return [read_json(path) for path in sorted(require_record_folder(directory).glob("fine-tuning-*.json"))]


def training_peaks(model: str = "e4b-shape", directory: Path = GPU_TIER_DIR) -> dict:
    """Sequence -> measured peak bytes of one training step on the whole GPU (the profile the planner is fitted on)."""
    record = gpu_tier_file(f"fine-tuning-{model}-profile.json", directory)
    return {row["sequence"]: row["peak_bytes"] for row in record["runs"] if row["outcome"] == "trained"}


def gguf_route(model: str = "e4b-shape", directory: Path = GGUF_DIR) -> dict:
    """The llama.cpp route measured on a CPU for one checkpoint (``python -m helpers.gguf_route measure``)."""
    path = Path(directory) / f"{model}.json"
    if not path.is_file():
        raise NoRecordError(f"No llama.cpp record at {path}: run "
                            f"`python -m helpers.gguf_route measure {model} --record`.")
    return read_json(path)


def cited_route_comparison(directory: Path = GGUF_DIR) -> dict:
    """The seed article's comparison of the two routes, as it stands (cited, not measured)."""
    return read_json(Path(directory) / "cited.json")


def cited_decode_speeds(directory: Path = CITED_DIR) -> dict:
    """Published decode speeds of other routes, the anchors the course's own speeds stand beside (cited, not measured)."""
    return read_json(Path(directory) / "decode-speeds.json")


def plain_string_outcomes(directory: Path = CHAT_DIR) -> list:
    """What each probed transformers release does with a plain-string message (tools/probe_plain_strings.py)."""
    path = Path(directory) / "plain-string-content.json"
    if not path.is_file():
        raise NoRecordError(f"No record at {path}: run `python tools/probe_plain_strings.py 5.5.2 5.7.0`.")
    return read_json(path)


def plain_string_outcome(transformers_version: str, processor: str, directory: Path = CHAT_DIR) -> str | None:
    """What the record says ``tokenize=True`` does with a plain-string message on this transformers release and
    processor class; None where that pair was not probed."""
    return next((entry["tokenize=True"] for entry in plain_string_outcomes(directory)
                 if entry["transformers"] == transformers_version and entry["processor"] == processor), None)


def decode_speed(route: str, model: str = "e4b-shape", quant: str = "nf4", directory: Path = MEASUREMENTS_DIR) -> float:
    """The speed preset's decode tokens/s for one route (``ple-cpu``, ``cpu-entry``, ...)."""
    speeds = decode_speeds(model, quant, directory)
    if not isinstance(route, str) or route not in speeds:
        raise InvalidChoiceError(f"route={route!r} has no recorded decode speed for {model} {quant}; choose one of "
                                 f"{', '.join(speeds)}.")
    return speeds[route]


def plain_generate_rate(record: dict, records) -> float | None:
    """Plain ``generate``'s tokens/s among ``records`` (one run) for the same model, PLE placement and card as
    ``record``: what its speed-up is a ratio of; None where the run has none, or ``record`` is it."""
    if not isinstance(record, dict) or not isinstance(record.get("configuration"), dict):
        raise InvalidChoiceError(f"record={record!r} is not a benchmark record; pass a dict lab.bench recorded.")
    config = record["configuration"]
    same = ("model", "ple", "card_gb")
    plain = next((r for r in records if r["configuration"].get("decode") == "generate"
                  and all(r["configuration"].get(key) == config.get(key) for key in same)), None)
    return plain.get("decode_tokens_per_s") if plain is not None and plain is not record else None


def rounding_sentence(check: dict) -> str:
    """How far kernels that round differently stayed from their reference, from an ``identity`` result."""
    rounding = check["rounding"]
    verdict = "within rounding" if rounding["within_rounding"] else "further than rounding"
    parted = ("the greedy tokens never part" if rounding["tokens_part_at"] is None
              else f"the greedy tokens part at step {rounding['tokens_part_at']}")
    control = "caught" if check.get("rounding_control_caught") else "NOT caught"
    return (f"{verdict}: {judged_difference(rounding)} against a bound of {rounding['bound']} x "
            f"the reference's spread {rounding['reference_std']:.2f}, over the {rounding['compared_steps']} steps until "
            f"{parted}; the control, the reference one step late as a cache one position off would give: {control}")


def judged_difference(rounding: dict) -> str:
    """The difference a rounding verdict was judged on, named: the root mean square, or the largest."""
    if rounding["statistic"] == "rms":
        return f"root mean square difference {rounding['rms_diff']:.3g} (largest {rounding['max_abs_diff']:.3g})"
    return f"largest difference {rounding['max_abs_diff']:.3g}"


@dataclass(frozen=True)
class Table:
    """A recorded table, ready to read: its cells are formatted, the command that recorded it is named. A notebook
    shows it as is; ``tools/render_results.py`` writes the same table into ``docs/results.md`` (``markdown``)."""

    columns: tuple
    rows: tuple
    command: str = ""

    def markdown(self) -> str:
        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in self.rows])

    def _repr_markdown_(self) -> str:
        return self.markdown() + (f"\n\nRecorded by `{self.command}`." if self.command else "")

    def __str__(self) -> str:
        widths = [max(len(cell) for cell in column) for column in zip(self.columns, *self.rows)]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip()
                         for row in (self.columns, *self.rows))

    def _repr_pretty_(self, printer, cycle):  # a console or a notebook's plain text: the table, not the dataclass
        printer.text(str(self))

    def __bool__(self) -> bool:
        return bool(self.rows)


def _ratio(rate, reference) -> str:
    return f"{rate / reference:.2f}" if rate and reference else "-"


def _outcome(record: dict, rate) -> str:
    """A rate, or why a configuration has none."""
    return str(rate or record.get("crashed") or record.get("load_error") or ("out of memory" if record.get("greedy_oom") else "-"))


def _identity(check: dict) -> str:
    if not check:
        return "-"
    if not check.get("compared"):
        return "not compared"
    if check.get("control"):
        return "told apart (control)" if check.get("told_apart") else "NOT told apart (control)"
    if check.get("rounding"):
        return f"differ from step {check['first_difference']}; {rounding_sentence(check)}"
    return ("identical" if check.get("identical") else f"differ from step {check.get('first_difference')}") + \
        f" over {check.get('steps')} steps"


def profile_covers(record: dict) -> str:
    """What a decode record's profile covered: newer ones the decode loop alone (``decoding.profile`` found its
    range), older ones the whole profiled run, prefill included."""
    by_step = (record.get("profile") or {}).get("by_step", {})
    if "forwards" in by_step:
        return f"the decode loop alone ({by_step['forwards']} forwards), the prefill left out"
    return f"{(record.get('profile') or {}).get('steps', 16)} steps and the prefill before them"


def _decode_speed(directory: Path, preset: str = "decode-speed", reference: str = "generate") -> Table:
    """Each mode of a decode preset's run: speed, its ratio to ``reference`` of the same run, identity and profile."""
    run = preset_records(preset, directory=directory)
    plain = run.get(reference, {}).get("decode_tokens_per_s")
    rows = []
    for name, record in run.items():
        rate, profile = record.get("decode_tokens_per_s"), record.get("profile") or {}
        launches, busy = profile.get("by_step", {}).get("launches"), profile.get("device_busy_fraction")
        kernels = kernels_per_step(record)
        limit = record.get("bandwidth_limit_tokens_per_s")
        sampled = sampled_busy(record)
        rows.append((name, _outcome(record, rate), _ratio(rate, plain), str(limit or "-"),
                     f"{rate / limit:.1%}" if rate and limit else "-",
                     _identity(record.get("identity", {})), f"{launches:,.0f}" if launches else "-",
                     f"{kernels:,.0f}" if kernels else "-", f"{busy:.0%}" if busy else "-",
                     f"{sampled:.0%}" if sampled is not None else "-"))
    columns = ("mode", "tokens/s", {"generate": "x plain generate", "cudagraphs": "x CUDA-graph step"}[reference],
               "bandwidth limit, tokens/s", "of the limit", "logits vs generate with a static cache",
               "CPU launches per step (profile)", "GPU kernels per step (profile)", "GPU busy (profile)",
               "GPU busy (driver-sampled, no tracer)")
    if not any(sampled_busy(record) is not None for record in run.values()):  # a run from before the sampler
        columns, rows = columns[:-1], [row[:-1] for row in rows]
    return Table(columns, tuple(rows), _command(run))


def sampled_busy(record: dict) -> float | None:
    """The share of the timed decode in which the GPU ran a kernel, from the driver's utilization samples (NVML)
    with no tracer attached; None where it was not sampled (a CPU, or a record older than the sampler)."""
    if not isinstance(record, dict):
        raise InvalidChoiceError(f"record={type(record).__name__} is not a decode record; pass one of "
                                 f"records.preset_records(preset)'s values.")
    return (record.get("gpu_busy_sampled") or {}).get("share")


def kernels_per_step(record: dict) -> float | None:
    """The GPU kernels one decode step ran, from the record's profile (None where it was not profiled)."""
    return ((record.get("profile") or {}).get("by_step") or {}).get("kernels")


def kernel_time_share(record: dict) -> dict | None:
    """How much of a decode step the GPU spends in kernels, the tracer left out: the profile's kernel time per forward
    over the untraced step (1 / tokens per second). CUPTI's tracing adds gaps between kernels, so the profile's own
    share (kernel time over the traced wall) reads low for steps of many short kernels. None without a decode-loop
    profile."""
    profile = record.get("profile") or {}
    forwards, rate = (profile.get("by_step") or {}).get("forwards"), record.get("decode_tokens_per_s")
    if not (forwards and rate and profile.get("device_busy_s")):
        return None
    kernel_ms, untraced_ms = 1e3 * profile["device_busy_s"] / forwards, 1e3 / rate
    return {"kernel_ms": kernel_ms, "traced_ms": profile["by_step"]["wall_ms"], "untraced_ms": untraced_ms,
            "share": kernel_ms / untraced_ms}


def _decode_speed_inductor(directory: Path) -> Table:
    run = preset_records("decode-speed-inductor", directory=directory)
    reference = run.get("generate-static", {}).get("decode_tokens_per_s")
    rows = tuple((name, _outcome(record, record.get("decode_tokens_per_s")), _ratio(record.get("decode_tokens_per_s"), reference),
                  _identity(record.get("identity") or {})) for name, record in run.items()) if reference else ()
    return Table(("mode", "tokens/s", "x generate-static", "logits vs generate-static"), rows, _command(run))


def _decode_speed_elsewhere(directory: Path) -> Table:
    rows, commands = [], []
    for preset, model in (("decode-speed-more", "e4b-shape"), ("decode-host-free-more", "e4b-shape"),
                          ("decode-speed-e2b", "e2b-shape")):
        run = preset_records(preset, model, directory)
        history = decode_rates_over_runs(preset, model, directory)
        commands += [_command(run)] if run else []
        for name, record in run.items():
            config, rate = record["configuration"], record.get("decode_tokens_per_s")
            runs = history.get(name, [])
            rows.append((name, model, config["ple"].upper(), f"{config['card_gb']:g} GB" if config.get("card_gb") else "uncapped",
                         _outcome(record, rate), _ratio(rate, plain_generate_rate(record, run.values())),
                         f"{min(runs)}-{max(runs)} ({len(runs)} runs)" if len(runs) > 1 else "one run"))
    return Table(("configuration", "model", "PLE on", "card", "tokens/s", "x plain generate", "tokens/s over recorded runs"),
                 tuple(rows), "; ".join(commands))


def _command(run: dict) -> str:
    return next(iter(run.values()))["command"] if run else ""


def _gpu_tier_memory(directory: Path) -> Table:
    tier = gpu_tier(directory=directory)
    rows = tuple((route, f"{tier[route]['resident_bytes'] / 1e9:.2f}", f"{tier[route]['reserved_bytes'] / 1e9:.2f}")
                 for route in ("ple-gpu", "post-load", "ple-cpu") if tier.get(route))
    return Table(("route", "allocated after load, GB", "reserved, GB"), rows, "GPU_RECORD=1 make test-gpu")


def host_memory_table(model: str = "e4b-shape", quant: str = "nf4", directory: Path = GPU_TIER_DIR) -> Table:
    """The GPU tier's host memory peaks by route: anonymous (what runs a VM out of RAM) and file-backed (page cache)."""
    routes = gpu_tier_host(model, quant, directory)
    rows = tuple((route, f"{r['host_load_anon_peak_bytes'] / 1e9:.2f}", f"{r['host_generate_anon_peak_bytes'] / 1e9:.2f}",
                  f"{r['host_load_file_peak_bytes'] / 1e9:.2f}", f"{r['host_generate_file_peak_bytes'] / 1e9:.2f}")
                 for route, r in sorted(routes.items()) if r and r.get("host_load_anon_peak_bytes"))
    return Table(("route", "anonymous, load (GB)", "anonymous, generate (GB)", "file-backed, load (GB)",
                  "file-backed, generate (GB)"), rows, "GPU_RECORD=1 make test-gpu-tier")


def _versus_ple_gpu(check: dict) -> str:
    if check["identical"]:
        return f"identical over {check['steps']} steps"
    return f"differ from step {check['first_difference']} (max abs difference {check['max_abs_diff']:.3g})"


def _ple_offload(directory: Path) -> Table:
    tier = gpu_tier(directory=directory)
    context = tier["ple-gpu"]["prefill"][0]["context"]
    reference = f"reference ({tier['ple-gpu']['greedy_distinct_tokens']} distinct tokens)"
    rows = tuple((route, f"{tier[route]['resident_bytes'] / 1e9:.2f}",
                  f"{tier[route]['prefill'][0]['peak_bytes'] / 1e9:.2f}" if tier[route]["prefill"] else "-",
                  reference if route == "ple-gpu" else _versus_ple_gpu(tier[route]["logits_vs_ple_gpu"]))
                 for route in ("ple-gpu", "ple-cpu", "ple-cpu-nudged"))
    return Table(("route", "allocated after load, GB", f"peak, {context:,}-token prefill, GB", "logits vs PLE on GPU"), rows,
                 "GPU_RECORD=1 make test-gpu")


def _decode_by_route(directory: Path) -> Table:
    speeds = decode_speeds(directory=directory)
    rows = tuple((route, f"{rate}", f"{1 / rate:.3f}") for route, rate in speeds.items())
    return Table(("route", "decode tokens/s", "s per token"), rows, "python -m lab.bench speed")


def first_difference_at(result: dict) -> str:
    """Where two runs of a determinism comparison first differ: "never" when identical at every step."""
    if result["first_differing_step"] is None:
        return "never"
    size = result.get("max_abs_diff_there")
    return f"step {result['first_differing_step']}" + (f" (max |diff| {size:.3g} there)" if size is not None else "")


def _determinism(directory: Path) -> Table:
    probe = gpu_tier_file("determinism-e4b-shape.json", directory)
    rows = (("the same model, twice", ", ".join(first_difference_at(r) for r in probe["gpu_run_to_run"])),
            ("with cuDNN's attention allowed, twice", first_difference_at(probe["cudnn_attention_run_to_run"])),
            ("PLE on CPU against PLE on GPU", first_difference_at(probe["cpu_vs_gpu_placement"])),
            ("PLE on CPU after an 8,500-token prefill, against before it",
             first_difference_at(probe["cpu_after_a_long_prefill_vs_before"])))
    rows = (("settings", probe["settings"]), *rows)
    return Table((f"over {probe['new_tokens']} greedy steps", "first different at"), rows,
                 f"{probe['command']} ({probe['gpu']}, {probe['date']})")


def _gguf_route(directory: Path) -> Table:
    e4b = gguf_route("e4b-shape", directory)
    ple = e4b["ple_tensor"]
    buffers = ", ".join(f"{name} {size / 1e9:.2f}" for name, size in e4b["model_buffers_bytes"].items())
    rows = (("Q4_K_M file", f"{e4b['q4_k_m_bytes'] / 1e9:.2f} GB"),
            (f"PLE table ({ple['name']})", f"{ple['type']}, {ple['bytes'] / 1e9:.2f} GB"),
            ("model buffers", f"{buffers} GB"),
            ("process memory added by loading", f"{e4b['rss_added_by_load_bytes'] / 1e9:.2f} GB"),
            (f"... and after {e4b['prompt_tokens']} + {e4b['new_tokens']} tokens", f"{e4b['rss_added_after_generate_bytes'] / 1e9:.2f} GB"))
    return Table(("E4B-shaped, llama.cpp", "recorded"), rows, e4b["command"])


def _route_comparison(directory: Path) -> Table:
    """The two routes side by side, each figure labelled where it was measured (recorded) or who published it
    (cited): E4B-shaped on the H200 and a CPU here, the seed article's RTX 4060."""
    e4b, hf = gguf_route("e4b-shape", directory), speed_record("e4b-shape", "ple-cpu")
    resident = gpu_tier_host("e4b-shape", "nf4")["ple-cpu"]["host_generate_file_peak_bytes"]  # page cache in use
    cited = {row["quantity"]: row["llama.cpp"] for row in cited_route_comparison(directory)["rows"]}
    ple, cpu = e4b["ple_tensor"], f"{e4b['threads']}-core CPU"
    ple_bf16 = ple["shape"][0] * ple["shape"][1] * 2
    prefill = hf["prefill"][0]
    rows = (("file", f"{e4b['checkpoint_bytes'] / 1e9:.1f} GB bf16 safetensors (recorded)",
             f"{e4b['q4_k_m_bytes'] / 1e9:.2f} GB Q4_K_M (recorded)"),
            ("GPU memory, weights", f"{hf['resident_bytes'] / 1e9:.2f} GB, H200 (recorded)", f"{cited['GPU memory']}, RTX 4060 (cited)"),
            ("host memory, PLE table", f"{ple_bf16 / 1e9:.2f} GB bf16, memory-mapped, {resident / 1e9:.2f} GB resident (recorded)",
             f"{ple['bytes'] / 1e9:.2f} GB {ple['type']}, mapped (recorded)"),
            ("load", f"{hf['load_s']} s, H200 (recorded)", f"{e4b['load_seconds']:.1f} s, {cpu} (recorded)"),
            ("prefill, tokens/s", f"{prefill['tokens_per_s']:,} at {prefill['context']} tokens, H200 (recorded)",
             f"{e4b['prefill_tokens_per_s']} at {e4b['prompt_tokens']} tokens, {cpu} (recorded)"),
            ("decode, tokens/s", f"{hf['decode_tokens_per_s']}, H200 (recorded)",
             f"{e4b['decode_tokens_per_s']}, {cpu} (recorded); RTX 4060: {cited['decode speed']} (cited)"),
            ("multimodal", "the processor: images, audio (notebook 07)",
             "a separate mmproj GGUF (converter --mmproj) and libmtmd; not run here"),
            ("fine-tuning", "PEFT/LoRA on the loaded model (notebook 10)", f"{cited['fine-tuning']} (cited)"))
    return Table(("", "transformers, NF4, PLE on the CPU", f"llama.cpp, Q4_K_M ({cpu} unless cited)"), rows,
                 f"{e4b['command']}; {hf['command']}")


def _cited_route_comparison(directory: Path) -> Table:
    cited = cited_route_comparison(directory)
    rows = tuple((row["quantity"], row["transformers"], row["llama.cpp"]) for row in cited["rows"])
    return Table(("as the seed article has it", "transformers", "llama.cpp"), rows, f"cited: {cited['source']}")


def _cited_decode_speeds(directory: Path) -> Table:
    cited = cited_decode_speeds(directory)
    rows = tuple((row["route"], row["gpu"], f"about {row['decode_tokens_per_s']}") for row in cited["rows"])
    return Table(("route (cited, not measured here)", "GPU", "tokens/s"), rows, f"cited: {cited['source']}")


def _plain_string_outcomes(directory: Path) -> Table:
    rows = tuple((entry["transformers"], entry["processor"], entry["tokenize=False"], entry["tokenize=True"])
                 for entry in plain_string_outcomes(directory))
    return Table(("transformers", "processor", "tokenize=False", "tokenize=True"), rows,
                 "python tools/probe_plain_strings.py 5.5.2 5.6.2 5.7.0 5.17.0 5.24.0")


TABLES = {"ple-offload": (_ple_offload, GPU_TIER_DIR), "decode-by-route": (_decode_by_route, MEASUREMENTS_DIR),
          "determinism": (_determinism, GPU_TIER_DIR), "gpu-tier-memory": (_gpu_tier_memory, GPU_TIER_DIR),
          "decode-speed": (_decode_speed, MEASUREMENTS_DIR),
          "decode-host-free": (lambda directory: _decode_speed(directory, "decode-host-free"), MEASUREMENTS_DIR),
          "decode-fused-norms": (lambda directory: _decode_speed(directory, "decode-fused-norms"), MEASUREMENTS_DIR),
          "decode-fused": (lambda directory: _decode_speed(directory, "decode-fused", "cudagraphs"), MEASUREMENTS_DIR),
          "decode-gemv": (lambda directory: _decode_speed(directory, "decode-gemv", "cudagraphs"), MEASUREMENTS_DIR),
          "decode-host-free-inductor": (lambda directory: _decode_speed(directory, "decode-host-free-inductor",
                                                                        "cudagraphs"), MEASUREMENTS_DIR),
          "decode-goal": (lambda directory: _decode_speed(directory, "decode-goal", "cudagraphs"), MEASUREMENTS_DIR),
          "decode-goal-cards": (lambda directory: _decode_speed(directory, "decode-goal-cards", "cudagraphs"),
                                MEASUREMENTS_DIR),
          "decode-speed-inductor": (_decode_speed_inductor, MEASUREMENTS_DIR),
          "decode-speed-elsewhere": (_decode_speed_elsewhere, MEASUREMENTS_DIR), "gguf-route": (_gguf_route, GGUF_DIR),
          "route-comparison": (_route_comparison, GGUF_DIR), "cited-route-comparison": (_cited_route_comparison, GGUF_DIR),
          "cited-decode-speeds": (_cited_decode_speeds, CITED_DIR),
          "plain-string-outcomes": (_plain_string_outcomes, CHAT_DIR),
          "host-memory": (lambda directory: host_memory_table(directory=directory), GPU_TIER_DIR)}


def table(name: str, directory: Path | None = None) -> Table:
    """A recorded table by name (``TABLES``), the one ``docs/results.md`` shows; empty where nothing is recorded yet."""
    if name not in TABLES:
        raise InvalidChoiceError(f"name={name!r} is not a recorded table; choose one of {', '.join(TABLES)}.")
    build, default = TABLES[name]
    return build(Path(directory) if directory is not None else default)
