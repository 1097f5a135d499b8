"""The dashboard's form: one control per Strategy field, derived from the field metadata.

Every field whose ``setting(...)`` names a control gets one (labkit.config), in declaration
order, grouped by its axis; a new Strategy field shows up here without an edit.
"""
from __future__ import annotations

import ipywidgets as W

from ..config import strategy_fields

STRATEGY_FIELDS = tuple(f.name for f in strategy_fields() if f.metadata["control"] is not None)
GROUPS = (("Degrees", "degrees"), ("Pipeline (pp > 1)", "pp"), ("Data parallel", "dp"),
          ("Tensor parallel (tp > 1)", "tp"), ("Sharding (zero > 0)", "zero"),
          ("Precision and memory", "compute"))


def build_controls(strategy, world_size: int) -> dict:
    """{field name: widget} for every Strategy field with a control, set to ``strategy``'s values."""
    return {f.name: control(f, getattr(strategy, f.name), world_size)
            for f in strategy_fields() if f.metadata["control"] is not None}


def groups() -> list[tuple[str, list[str]]]:
    """(title, field names) per axis that has controls, in the panel's order."""
    axis_of = {f.name: f.metadata["axis"] for f in strategy_fields()}
    found = [(title, [n for n in STRATEGY_FIELDS if axis_of[n] == axis]) for title, axis in GROUPS]
    return [(title, names) for title, names in found if names]


def control(f, value, world_size: int) -> W.Widget:
    """The widget a Strategy field's metadata asks for (labkit.config.setting)."""
    kind, title = f.metadata["control"], f.metadata["title"] or f.name
    if kind == "degree":
        return W.Dropdown(options=list(range(1, world_size + 1)), value=value, description=title)
    if kind == "choice":
        return W.Dropdown(options=f.metadata["choices"], value=value, description=title)
    if kind == "bool":
        return W.Checkbox(value=value, description=title)
    name, lo, hi = kind
    if name == "int":
        return W.IntSlider(value=value, min=lo, max=hi, description=title)
    return W.FloatLogSlider(value=value, base=2, min=lo, max=hi, step=1, description=title, readout_format=".3g")


def check_offered(name: str, value, control) -> None:
    """ValueError unless ``control`` can show ``value`` as it is: a dropdown would raise a
    TraitError, a slider would clamp to its end without a word (``Dashboard.set``)."""
    if isinstance(control, W.Dropdown):
        if not any(type(value) is type(o) and value == o for o in control.options):
            raise ValueError(f"dash.set({name}={value!r}): the {name} control offers "
                             f"{', '.join(map(repr, control.options))}")
        return
    if isinstance(control, W.FloatLogSlider):
        low, high = control.base ** control.min, control.base ** control.max
    elif hasattr(control, "min"):
        low, high = control.min, control.max
    else:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ValueError(f"dash.set({name}={value!r}): the {name} control goes from {low:g} to {high:g}")


def model_limits(built, world_size: int, chunks_max: int = 4) -> dict[str, str]:
    """{axis: why} for what the dashboard cannot run on ``built`` (a model, read for its
    structure only), each a sentence the panel shows beside that axis's controls; its keys:
    "tp" (no tensor plan, and the dashboard cannot pass ``tp_plan=``), "interleaved" (no
    pp·chunks of this lab splits the blocks into equal stages, and ``split_at`` has no
    control), "bucket" (a hint: below the largest gradient, every bucket holds one tensor)."""
    from ..parallel.blocks import find_blocks
    from ..parallel.tensor.plan import resolve_plan

    limits = {}
    try:
        resolve_plan(built)
    except ValueError:
        limits["tp"] = "tp > 1: this model has no tp_plan (lab.run(..., tp_plan=...) takes one; the gpt choice has one)"
    blocks = len(find_blocks(built))
    splits = [pp * c for pp in range(2, world_size + 1) if world_size % pp == 0 for c in range(2, chunks_max + 1)]
    if not any(blocks % n == 0 for n in splits):
        limits["interleaved"] = (f"interleaved: not offered: this model's {blocks} blocks split into no "
                                 "pp·chunks equal stages here (lab.run takes split_at=...)")
    largest = max((p.numel() * p.element_size() for p in built.parameters()), default=0)
    if largest:
        limits["bucket"] = (f"largest gradient {largest / 2**20:.3g} MiB: below it, buckets mostly hold one "
                            "tensor each, and smaller sizes change little")
    return limits


def model_choices(model, data, loss, batch: int) -> dict:
    """{label: (model, data, loss)} for the dashboard's model control: the model given (if any,
    or "mlp" / "gpt" by name), the MLP on synthetic data, and a small GPT on text."""
    from .. import data as text_data
    from .. import models

    text = text_data.text(batch=batch, block_size=32)
    presets = {"mlp": (models.mlp(width=256, depth=8), None, "mse"),
               "gpt": (models.gpt(n_layer=2, n_head=4, n_embd=64, block_size=32, vocab_size=text.vocab_size),
                       text, "cross_entropy")}
    if isinstance(model, str):
        if model not in presets:
            raise ValueError(f"Dashboard(model={model!r}): use 'mlp', 'gpt' or a model")
        return {model: presets[model], **presets}
    return {"yours": (model, data, loss), **presets} if model is not None else presets
