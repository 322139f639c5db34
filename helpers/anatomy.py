"""Reading a model you did not write: its module tree, sizes per device and dtype, tied weights.

Sizes come from accelerate's ``compute_module_sizes``; on a meta-device model they cost no
memory, so E4B can be inspected on any laptop.
"""

from __future__ import annotations

import difflib
import warnings
from collections import defaultdict
from dataclasses import dataclass

from .errors import InvalidChoiceError, require_bool, require_whole_number
from .placement import human_bytes, modules_named, require_model, unique_tensors  # noqa: F401 (modules_named: notebook 04)


def module_sizes(model) -> dict:
    """Bytes per module name, including its children (accelerate's own accounting)."""
    from accelerate.utils import compute_module_sizes

    require_model(model)
    return compute_module_sizes(model)


@dataclass
class Tree:
    lines: list

    def __str__(self) -> str:
        return "\n".join(self.lines)

    def _repr_pretty_(self, printer, cycle):
        printer.text(str(self))


def tree(model, max_depth: int = 2, root: str = "") -> Tree:
    """The module tree down to ``max_depth``, each line with its class and size."""
    sizes = module_sizes(model)
    require_whole_number(max_depth, "max_depth", minimum=0)
    start = submodule(model, root)
    lines = []
    for name, module in start.named_modules():
        full = f"{root}.{name}" if root and name else (root or name)
        depth = name.count(".") + 1 if name else 0
        if depth > max_depth:
            continue
        children = sum(1 for _ in module.children())
        more = f"  ({children} children)" if depth == max_depth and children else ""
        # the root has no attribute name: its class alone (not "Gemma4ForConditionalGeneration: Gemma4ForConditionalGeneration")
        named = f"{full.rsplit('.', 1)[-1]}: " if full else ""
        lines.append(f"{'    ' * depth}{named}{type(module).__name__}  {human_bytes(sizes.get(full, 0))}{more}")
    return Tree(lines)


def submodule(model, name: str):
    """``model.get_submodule(name)`` (the model itself for ``""``), or the sentence naming the closest module."""
    if not isinstance(name, str):
        raise InvalidChoiceError(f"root={name!r} is not a module name; pass a string such as 'model.language_model'.")
    try:
        return model.get_submodule(name) if name else model
    except AttributeError:
        names = [n for n, _ in model.named_modules() if n]
        closest = difflib.get_close_matches(name, names, n=1, cutoff=0.0)
        raise InvalidChoiceError(f"root={name!r} is no module of {type(model).__name__}; did you mean {closest[0]!r}?") from None


def bytes_by_device_and_dtype(model) -> dict:
    """``{(device, dtype): bytes}`` over parameters and buffers, tied weights counted once."""
    require_model(model)
    totals: dict = defaultdict(int)
    for _, _, _, tensor in unique_tensors(model):
        totals[(str(tensor.device), str(tensor.dtype).replace("torch.", ""))] += tensor.numel() * tensor.element_size()
    return dict(totals)


def tied_parameters(model) -> list:
    """Groups of parameter names that share one tensor (accelerate's ``find_tied_parameters``)."""
    from accelerate.utils import find_tied_parameters

    return find_tied_parameters(require_model(model))


def parameter_count(model, count_tied_once: bool = True) -> int:
    require_model(model)
    require_bool(count_tied_once, "count_tied_once")
    params = model.named_parameters(remove_duplicate=count_tied_once)
    return sum(p.numel() for _, p in params)


def explorer(model):
    """An ipywidgets browser of the module tree: pick a child to go down, ``..`` to go up.

    Without ipywidgets it says how to get it and returns the text tree instead."""
    require_model(model)
    try:
        import ipywidgets as widgets
    except ImportError:
        warnings.warn("The explorer needs ipywidgets: `pip install ipywidgets`, then restart the kernel. "
                      "Showing the text tree instead.", stacklevel=2)
        return tree(model, max_depth=3)

    # the tree as plain names: the widgets live in ipywidgets' registry until closed, and a model their
    # callbacks held would stay on the GPU after `del model`
    sizes, root = module_sizes(model), type(model).__name__
    kids: dict = defaultdict(list)
    for full, module in model.named_modules():
        if full:
            parent, _, name = full.rpartition(".")
            kids[parent].append((name, type(module).__name__))
    path = widgets.Text(value="", description="module", disabled=True, layout=widgets.Layout(width="80%"))
    children = widgets.Select(rows=14, layout=widgets.Layout(width="80%"))

    def show(prefix: str) -> None:
        options = [("..", "..")] if prefix else []
        for name, kind in kids[prefix]:
            full = f"{prefix}.{name}" if prefix else name
            options.append((f"{name}: {kind}  {human_bytes(sizes.get(full, 0))}", full))
        path.value = prefix or f"({root})"
        children.unobserve(on_pick, names="value")
        children.options = options
        children.value = None
        children.observe(on_pick, names="value")

    def on_pick(change) -> None:
        if change["new"] is None:
            return
        current = "" if path.value.startswith("(") else path.value
        target = current.rsplit(".", 1)[0] if change["new"] == ".." and "." in current else (
            "" if change["new"] == ".." else change["new"])
        show(target)

    children.observe(on_pick, names="value")
    show("")
    return widgets.VBox([path, children])
