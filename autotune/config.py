"""A configuration: one value for every knob, validated, JSON round-trippable."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from autotune.errors import ConfigError

__all__ = ["Config", "split_record"]


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

    Example:
        >>> cfg = Config({"batch_size": 64, "amp_dtype": "bfloat16"})
        >>> Config.from_json(cfg.to_json()) == cfg
        True
    """

    def __init__(self, values: Mapping[str, Any] | None = None) -> None:
        from autotune.knobs import REGISTRY, get_knob

        if values is not None and not isinstance(values, Mapping):
            raise ConfigError(f"A config must be a dict of knob values, but got {type(values).__name__}.")
        # A whole best_config.json gives its config part; `rebuild` is not a knob but how an
        # int8 winner's data draws are repeated (see autotune.apply).
        given, self.rebuild = split_record(values or {})
        resolved: dict[str, Any] = {}
        for name in given:
            get_knob(name)  # unknown name: lists the known ones
        for name, knob in REGISTRY.items():
            resolved[name] = knob.validate(given[name]) if name in given else knob.default
        self._values = resolved

    def __getitem__(self, name: str) -> Any:
        return self._values[name]

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
