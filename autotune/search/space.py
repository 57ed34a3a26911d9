"""Search spaces: a preset from ``search_spaces/``, the user's overrides, and the Env's verdict.

A preset is a TOML file with a ``description`` and a ``[knobs]`` table mapping a knob name to a
list of values or ``"all"`` (every value the Env can run). A knob a preset leaves out is fixed
at its baseline value. The baseline value of every knob is always a candidate, so the baseline
itself is a point of the space.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from autotune.config import Config
from autotune.errors import ConfigError
from autotune.knobs import REGISTRY, Offer, SpaceContext, get_knob

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["SearchSpace", "list_presets", "load_preset", "preset_options", "resolve_space"]


def _preset_files() -> dict[str, Any]:
    # Installed: the presets are the package autotune.search_spaces. Run from a source checkout
    # (the package imported from the working directory): they are the folder beside it.
    checkout = Path(__file__).resolve().parents[2] / "search_spaces"
    try:
        root: Any = resources.files("autotune.search_spaces")
    except ModuleNotFoundError:
        root = checkout
    return {p.name[: -len(".toml")]: p for p in root.iterdir() if p.name.endswith(".toml")}


def list_presets() -> dict[str, str]:
    """Preset names with their descriptions."""
    return {
        name: _parse(path.read_text(), name).get("description", "") for name, path in sorted(_preset_files().items())
    }


def _parse(text: str, where: str) -> dict[str, Any]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"Search space {where} is not valid TOML: {exc}.") from None
    knobs = data.get("knobs", {})
    if not isinstance(knobs, dict):
        raise ConfigError(f'Search space {where}: [knobs] must be a table of knob = [values] or "all".')
    return data


def load_preset(space: str | Path) -> dict[str, Any]:
    """Knob values of a preset given by name or TOML path (``{knob: list | "all"}``).

    Raises:
        ConfigError: no such preset or file, or its content is invalid.
    """
    return dict(_load(space).get("knobs", {}))


def preset_options(space: str | Path | Mapping[str, Any]) -> dict[str, Any]:
    """What a preset declares besides knobs: ``objectives = [...]`` and ``select = "..."``, which
    apply when the caller does not give its own."""
    if isinstance(space, Mapping):
        base = space.get("base", "default")
        return preset_options(base) if base is not None else {}
    data = _load(space)
    return {k: data[k] for k in ("objectives", "select") if data.get(k)}


def _load(space: str | Path) -> dict[str, Any]:
    files = _preset_files()
    text_space = str(space)
    if text_space in files:
        return _parse(files[text_space].read_text(), f"preset {text_space!r}")
    path = Path(text_space)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"Search space file {text_space!r} does not exist.")
        return _parse(path.read_text(), repr(text_space))
    raise ConfigError(f"No preset named {text_space!r}. Known: {', '.join(sorted(files))}; or give a .toml file.")


@dataclasses.dataclass
class SearchSpace:
    """The resolved space.

    Attributes:
        values: Candidate values per knob, in registry order (one value = fixed).
        baseline: The baseline configuration.
        excluded: Per knob, each value left out with its reason.
        objectives: What the study optimizes.
        select: The preset's choice of winner on the Pareto front, if it declares one.
    """

    values: dict[str, list[Any]]
    baseline: dict[str, Any]
    excluded: dict[str, dict[str, str]]
    objectives: list[str] = dataclasses.field(default_factory=lambda: ["throughput"])
    select: str | None = None

    @property
    def searched(self) -> dict[str, list[Any]]:
        """Knobs with more than one candidate."""
        return {n: v for n, v in self.values.items() if len(v) > 1}

    def size(self) -> int:
        """Upper bound of the number of distinct configurations."""
        return math.prod(len(v) for v in self.values.values())

    def contains(self, config: Mapping[str, Any]) -> bool:
        """Whether every active knob of ``config`` has a candidate value."""
        return all(config[n] in v for n, v in self.values.items() if REGISTRY[n].applies(dict(config)))


def _wanted(name: str, spec: Any, offered: list[Any], where: str) -> list[Any] | None:
    knob = get_knob(name)
    if spec == "all":
        return list(offered)
    if isinstance(spec, (list, tuple)) and spec:
        return [knob.validate(v) for v in spec]
    if spec is None:
        return None
    if not isinstance(spec, (list, tuple)):
        return [knob.validate(spec)]
    raise ConfigError(f'{where}: knob {name!r} needs a non-empty list of values or "all", but got {json.dumps(spec)}.')


def resolve_space(
    space: str | Path | Mapping[str, Any],
    ctx: SpaceContext,
    fix: Mapping[str, Any] | None = None,
) -> SearchSpace:
    """Resolve a preset name, TOML path or dict against the Env.

    A dict maps knob names to values (a list, one value or ``"all"``) on top of the preset named
    by its optional ``"base"`` entry (default ``"default"``; ``None`` for none, so only the
    listed knobs are searched). ``fix`` pins knobs to one value each.

    Raises:
        ConfigError: unknown preset or knob, an invalid value, or a fixed value this Env cannot run.
    """
    if isinstance(space, Mapping):
        overrides = dict(space)
        base = overrides.pop("base", "default")
        specs = load_preset(base) if base is not None else {}
        specs.update(overrides)
        where = "space"
    else:
        specs = load_preset(space)
        where = f"space {str(space)!r}"
    for name in specs:
        get_knob(name)
    fix = dict(fix or {})
    for name in fix:
        get_knob(name)

    values: dict[str, list[Any]] = {}
    baseline: dict[str, Any] = {}
    excluded: dict[str, dict[str, str]] = {}
    for name, knob in REGISTRY.items():
        base_value = knob.baseline(ctx)
        if ctx.mode in knob.modes:
            offer = knob.offer(ctx)
        else:
            why = f"only used in {' and '.join(knob.modes)} mode"
            offer = Offer([base_value], {json.dumps(c).strip('"'): why for c in knob.choices if c != base_value})
        baseline[name] = base_value
        reasons = dict(offer.excluded)
        if name in fix:
            value = knob.validate(fix[name])
            if value not in offer.values and value != base_value:
                why = offer.excluded.get(json.dumps(value).strip('"'), "not offered on this device")
                raise ConfigError(f"Cannot fix {name}={json.dumps(value)}: {why}.")
            values[name] = [value]
            excluded[name] = reasons
            continue
        spec = specs.get(name, "all" if name in _INT8_SETTINGS and _int8_searched(values) else None)
        wanted = _wanted(name, spec, offer.values, where)
        if wanted is None:
            chosen = [base_value]
        else:
            chosen = []
            for v in wanted:
                if v in offer.values or v == base_value:
                    if v not in chosen:
                        chosen.append(v)
                else:
                    key = json.dumps(v).strip('"')
                    reasons.setdefault(key, "not offered on this device")
            if base_value not in chosen:
                chosen.insert(0, base_value)
        values[name] = chosen
        excluded[name] = reasons
    _hold_for_fixed(values, baseline, excluded, {name: values[name][0] for name in fix})
    # A fixed knob does not move the baseline: the baseline stays the untuned pipeline, the
    # fixed value is what every other trial uses.
    return SearchSpace(values=values, baseline=baseline, excluded=excluded)


def _hold_for_fixed(
    values: dict[str, list[Any]],
    baseline: Mapping[str, Any],
    excluded: dict[str, dict[str, str]],
    fixed: Mapping[str, Any],
) -> None:
    """Leave out the runtimes under which a fixed knob would not apply.

    ``fix={"compile_mode": "default"}`` is what every trial after the baseline uses; a trial on
    another runtime, where compile_mode stands aside, would not be compiled, and a short budget
    could end with no compiled trial at all. So the runtimes that drop a fixed knob are left
    out (the baseline's own one stays: it is the untuned pipeline). A setting of one method
    (``ov_precision``, ``int8_fallback``) holds the runtime to the ones it applies under, never
    the other knobs to its method.
    """
    if "runtime" in fixed:  # the user's own word
        return
    base = {**baseline, **fixed}
    for name, value in fixed.items():
        knob, candidates = REGISTRY[name], values["runtime"]
        if value == baseline[name] or not any(knob.applies({**base, "runtime": v}) for v in candidates):
            continue
        kept = [v for v in candidates if v == baseline["runtime"] or knob.applies({**base, "runtime": v})]
        for v in candidates:
            if v not in kept:
                why = f"{name}={json.dumps(value)} is fixed, and applies only under another runtime"
                excluded.setdefault("runtime", {})[json.dumps(v).strip('"')] = why
        values["runtime"] = kept


# The settings of int8 that decide whether it holds the guard: searched wherever int8 is (fixed
# or offered) unless the space or ``fix`` says otherwise. They apply only to int8 trials.
_INT8_SETTINGS = ("int8_fallback", "int8_per_channel")


def _int8_searched(values: Mapping[str, list[Any]]) -> bool:
    methods = [*values.get("quantization", ()), *values.get("ort_precision", ()), *values.get("ov_precision", ())]
    return any(str(m).startswith("int8") for m in methods)


def _nearest(values: list[Any], target: float) -> Any:
    return min(values, key=lambda v: (abs(math.log(v / target)), v))


def warm_start(space: SearchSpace) -> list[dict[str, Any]]:
    """Configurations to measure right after the baseline: the changes that most often pay, in
    one recipe and one at a time.

    The sampler's first trials are random, and a small budget spent on random loader and thread
    settings can miss what an engineer would try first. So the study starts with the common
    recipe (lower-precision autocast, a larger batch, channels-last, a fused optimizer step),
    then each of those changes alone and ``torch.compile``: the sampler learns from them like
    from any trial. Only values the space offers are used; with speed not among the objectives
    (a size-first preset), there is none.

    Returns:
        Whole configurations (the baseline's values elsewhere), each distinct and not the baseline.
    """
    if not {"throughput", "latency"} & set(space.objectives):
        return []
    base, values = dict(space.baseline), space.values

    def offered(name: str, preferred: tuple[Any, ...]) -> dict[str, Any]:
        for value in preferred:
            if value in values.get(name, ()) and value != base.get(name):
                return {name: value}
        return {}

    amp = offered("amp_dtype", ("bfloat16", "float16"))
    larger = [b for b in values.get("batch_size", ()) if b > base["batch_size"]]
    batch2 = {"batch_size": _nearest(larger, 2 * base["batch_size"])} if larger else {}
    batch8 = {"batch_size": _nearest(larger, 8 * base["batch_size"])} if larger else {}
    layout = offered("channels_last", (True,))
    fused = offered("optimizer_impl", ("fused",))
    compiled = offered("compile_mode", ("default",))
    # Token sequences: the padding trimmed and batches of similar lengths, the text recipe.
    shape = {**offered("padding", ("trim", "trim_8")), **offered("length_grouping", (16, 4))}
    # INT8 that holds accuracy: the most sensitive layers kept float, as few as the guard allows.
    ort = offered("runtime", ("onnxruntime",))
    ort_int8 = {**ort, **offered("ort_precision", ("int8_dynamic",))} if ort else {}
    auto = {"int8_fallback": "auto"} if "auto" in values.get("int8_fallback", ()) else {}
    int8 = {**ort_int8, **auto} if len(ort_int8) == 2 else {}
    per_channel = {**int8, **offered("int8_per_channel", (True,))} if int8 else {}
    candidates = [{**amp, **batch2, **layout, **fused}, amp, batch2, batch8, shape, {**shape, **int8}]
    candidates += [{**shape, **per_channel}, compiled]
    candidates += [layout, fused]
    configs: list[dict[str, Any]] = []
    keys = {Config(base).key()}
    for changes in candidates:
        config = {**base, **changes}
        key = Config(config).key()
        if changes and key not in keys:
            keys.add(key)
            configs.append(config)
    return configs


def first_params(space: SearchSpace) -> list[dict[str, Any]]:
    """The searched parameters of the baseline and of :func:`warm_start`'s configurations, in
    the order a study measures them (for ``study.enqueue_trial``)."""
    return [
        {n: c[n] for n in space.searched if REGISTRY[n].applies(c)} for c in (dict(space.baseline), *warm_start(space))
    ]
