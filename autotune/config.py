"""A configuration: one value for every knob, validated, JSON round-trippable."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from autotune.errors import ConfigError

__all__ = ["Config", "KnobValues", "split_record", "values_of", "with_values"]


def split_record(data: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The knob values and the ``rebuild`` record of a config given as a dict.

    ``data`` is a dict of knob values (``result.best_config``, maybe with its ``rebuild`` entry)
    or a whole ``best_config.json``: then its ``config`` part, and its ``rebuild`` record with the
    int8 layers the run kept float (read from its ``int8`` entry for a run written before the
    record held them).
    """
    given = dict(data)
    if not isinstance(given.get("config"), Mapping):
        return given, given.pop("rebuild", None)
    record = dict(given.get("rebuild") or {})
    int8 = given.get("int8") if isinstance(given.get("int8"), Mapping) else {}
    if record.get("int8_kept_float") is None and isinstance(int8.get("kept_float"), list) and int8.get("n_layers"):
        record["int8_kept_float"] = int8["kept_float"]
    return dict(given["config"]), record or None


class Config(Mapping[str, Any]):
    """An immutable mapping from knob name to value.

    Knobs left out take their default (the untuned behaviour). Unknown names and invalid
    values raise :class:`~autotune.errors.ConfigError`. A whole ``best_config.json`` (as
    ``json.load`` reads it) gives its ``config`` part and keeps its ``rebuild`` record.

    A knob's value also reads as an attribute (``cfg.batch_size``), and knob values may be
    given as keywords: a misspelt name fails at once instead of reading as missing.

    Example:
        >>> cfg = Config(batch_size=64, amp_dtype="bfloat16")
        >>> cfg.batch_size, cfg.but(batch_size=8).batch_size
        (64, 8)
        >>> Config.from_json(cfg.to_json()) == cfg
        True
    """

    def __init__(self, values: Mapping[str, Any] | None = None, /, **knobs: Any) -> None:
        from autotune.knobs import REGISTRY, get_knob

        if values is not None and not isinstance(values, Mapping):
            raise ConfigError(f"A config must be a dict of knob values, but got {type(values).__name__}.")
        # A whole best_config.json gives its config part; `rebuild` is not a knob but how an
        # int8 winner's data draws are repeated (see autotune.apply).
        given, self.rebuild = split_record(values or {})
        given.update(knobs)
        resolved: dict[str, Any] = {}
        for name in given:
            get_knob(name)  # unknown name: lists the known ones
        for name, knob in REGISTRY.items():
            resolved[name] = knob.validate(given[name]) if name in given else knob.default
        self._values = resolved

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _knob_value(self._values, name)

    def but(self, **changes: Any) -> Config:
        """This config with ``changes`` (knob name to value), validated; the rebuild record kept."""
        changed = Config({**self._values, **changes})
        changed.rebuild = self.rebuild
        return changed

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"Config({self._values!r})"

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-safe dict."""
        return dict(self._values)

    def to_json(self) -> str:
        """The config as a JSON string."""
        return json.dumps(self._values, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Config:
        """Parse :meth:`to_json`'s output, or a ``best_config.json`` (its ``config`` and ``rebuild`` entries)."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"A config must be JSON, but parsing failed: {exc}.") from None
        return cls(data)

    def key(self) -> str:
        """A canonical string of the values that matter, to spot a configuration measured before."""
        from autotune.knobs import REGISTRY

        active = {n: v for n, v in self._values.items() if REGISTRY[n].applies(self._values)}
        return json.dumps(active, sort_keys=True)


def _knob_value(values: Mapping[str, Any], name: str) -> Any:
    from autotune.knobs import REGISTRY, get_knob

    if name not in REGISTRY:
        try:
            get_knob(name)
        except ConfigError as exc:
            raise AttributeError(str(exc)) from None
    return values[name] if name in values else REGISTRY[name].default


class KnobValues:
    """Attribute access to the knob values of a plain dict (a trial's stored config, a user's
    dict): ``values_of(config).compile_mode``; a knob the dict leaves out reads as its default,
    as :class:`Config` would give it, and a name that is no knob raises ``AttributeError``."""

    __slots__ = ("_values",)

    def __init__(self, values: Mapping[str, Any] | None) -> None:
        self._values = values if values is not None else {}

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return _knob_value(self._values, name)


def values_of(config: Mapping[str, Any] | None) -> KnobValues | Config:
    """``config``'s knob values as attributes, without validating them (see :class:`KnobValues`).

    Example:
        >>> v = values_of(dict(runtime="openvino"))
        >>> v.runtime, v.ov_precision
        ('openvino', 'fp32')
    """
    return config if isinstance(config, Config) else KnobValues(config)


def with_values(config: Mapping[str, Any], **changes: Any) -> Any:
    """``config`` with ``changes``, each named by its knob (a misspelt name raises): a
    :class:`Config` stays one (validated), any other mapping becomes a dict.

    Example:
        >>> with_values(dict(batch_size=8, compile_mode="default"), compile_mode="none") == dict(
        ...     batch_size=8, compile_mode="none"
        ... )
        True
    """
    if isinstance(config, Config):
        return config.but(**changes)
    from autotune.knobs import get_knob

    for name in changes:
        get_knob(name)
    return {**config, **changes}
