"""The knob contract: one tunable setting of the pipeline.

A knob has a name used everywhere (Optuna parameter, config key, CLI ``--fix name=value``,
JSON, docs), a :class:`Stage` that orders it in the build, the values it offers on an
:class:`~autotune.env.Env` (with a reason for every value it leaves out), and ``apply``, which
changes a :class:`~autotune.trial.build.BuildState`. Adding a knob means adding one file that
subclasses :class:`Knob` and decorates it with :func:`register`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from autotune.errors import ConfigError

if TYPE_CHECKING:
    from autotune.data import DataInfo
    from autotune.env import Env
    from autotune.knobs.state import BuildState

__all__ = ["Knob", "Offer", "SpaceContext", "Stage", "REGISTRY", "register", "get_knob"]


class Stage(enum.IntEnum):
    """Order in which knobs are applied when a configuration is built."""

    STRUCTURE = 0  # changes the architecture (pruning)
    WEIGHTS = 1  # changes weights, precision or layout
    COMPILE = 2  # turns the model into what runs (torch.compile, TorchScript, ONNX Runtime)
    LOADER = 3  # DataLoader keyword arguments
    RUNTIME = 4  # process-wide settings active while the model runs


@dataclasses.dataclass(frozen=True)
class SpaceContext:
    """What a knob may look at to decide its values."""

    env: Env
    data: DataInfo
    baseline_batch_size: int = 32
    objectives: tuple[str, ...] = ("throughput",)
    has_loss_fn: bool = False
    mode: str = "inference"
    # Training mode with a fixed effective batch: micro-batches must divide it.
    effective_batch_size: int | None = None
    # The loader settings of a DataLoader the user gave: the baseline's num_workers and the like.
    loader: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # Why calibration (static int8, int8_fallback) has no samples outside validation, if so.
    no_calibration: str | None = None
    # How many layers carry weights int8 can quantize (nn.Linear, LSTM, GRU, convolutions), if known.
    n_quantizable: int | None = None
    # The same samples are read again in use (training epochs, or the user's repeated_passes).
    repeated_passes: bool = False
    # What the samples' first resize needs of the JPEG files their __getitem__ decodes with PIL
    # ("shorter side 256"), where decoding them at reduced scale applies (autotune.knobs.decode).
    jpeg: str | None = None
    # The transform of a torchvision folder dataset as the device would run it ("resize shorter
    # side 256, centre crop 224x224, ..."), where decoding on the device applies, else why not
    # (autotune.knobs.device_decode).
    device_decode: str | None = None
    device_decode_why: str | None = None


@dataclasses.dataclass(frozen=True)
class Offer:
    """Values a knob offers on an Env, and the reason each other value is left out."""

    values: list[Any]
    excluded: dict[str, str] = dataclasses.field(default_factory=dict)


class Knob:
    """Base class of every knob.

    Subclasses set ``name``, ``stage``, ``order``, ``choices`` (every value the knob knows, in a
    sensible order), ``default``, ``help`` and, for a knob of one mode only, ``modes``, and
    implement :meth:`apply`. They override :meth:`offer` to leave out values the Env cannot run,
    :meth:`applies` when the knob only matters given other knobs' values, and :meth:`activate`
    when the knob is a process-wide setting (``Stage.RUNTIME``) that must be on while the model runs.

    A knob lives in its own module of :mod:`autotune.knobs` (or beside its family) and is found
    there: nothing else in autotune names it.
    """

    name: ClassVar[str]
    stage: ClassVar[Stage]
    # Where the knob sits among all knobs: the order configurations are suggested in (a knob
    # that depends on another, prefetch_factor on num_workers, comes after it) and, within its
    # stage, the order the build applies it in.
    order: ClassVar[int] = 1000
    choices: ClassVar[tuple[Any, ...]]
    default: ClassVar[Any]
    help: ClassVar[str] = ""
    # The modes (``inference``, ``train``) in which the knob is searched; elsewhere it stays at
    # its baseline value.
    modes: ClassVar[tuple[str, ...]] = ("inference", "train")

    # What the staged search (autotune.search) knows of the knob. A knob with a lever of its own
    # declares it here and is screened without any other module naming it; a lever that sets
    # several knobs together (trimmed padding with length grouping, a runtime with its precision,
    # loader workers beside threads, the data path on CUDA) is written in autotune/search/levers.py.
    # ``screen``: the lever's variants in order of promise, each a value of the knob, or a mapping
    # of knobs to the values preferred for each (the first the space offers, not the baseline's);
    # ``()``: no lever of its own.
    screen: ClassVar[tuple[Any, ...]] = ()
    # Where the lever is screened among all levers (lower first; search/levers.py gives the ranks
    # of the levers it writes: padding 10, image shapes 20, OpenVINO 50, int8 60, compile 70).
    screen_rank: ClassVar[int] = 1000
    # Screened in the first tier: alone on the baseline before anything is composed.
    first_tier: ClassVar[bool] = False
    # A change of the knob costs a build of its own (a compile, an export, a calibration, a
    # pruning): the search prices it by the builds of its kind (autotune.search.cost), screens it
    # after the cheap levers and keeps it at the fastest build's value while refining.
    heavy: ClassVar[bool] = False
    # Not a build of its own, but another price for one (a runtime's int8 against its float).
    prices: ClassVar[bool] = False
    # Kept with the build's kind while refining (autotune.search.strategy), like a heavy knob.
    held: ClassVar[bool] = False

    # What the rest of autotune asks of every knob, declared here rather than listed there
    # (read through :func:`autotune.knobs.declared`):
    # ``side``: the half of the pipeline the knob changes: "model", "loader" (what the loader
    # delivers per second) or "both" (the batch size): how the diagnosis explains a change.
    side: ClassVar[str] = "model"
    # It changes how much memory a batch needs: a batch that ran out of memory with the same
    # values of these knobs is not tried larger.
    memory: ClassVar[bool] = False
    # It decides which code runs: "path" (a failure repeats with the same values of every path
    # knob, whatever else changes) or "variant" (the same path on other layers or tokens: twice
    # failed with the same path and variant values, a configuration is not tried again).
    code: ClassVar[str | None] = None
    # Naming it in a space or in ``fix`` means the user chose runtimes or int8 themselves.
    deploy: ClassVar[bool] = False
    # Off its default, the build makes another model from the user's, on example inputs (traced,
    # exported, converted, calibrated or pruned): the run keeps those inputs beside the winner
    # (autotune.export.build_inputs) and a predictor warns that the build costs more than a copy.
    reads_inputs: ClassVar[bool] = False
    # On, it changes the numbers the model computes, process-wide (flushing denormals, TF32):
    # the parity checks run without it, so their outputs are not the winner's.
    numerics: ClassVar[bool] = False
    # On, the model does work per input shape on first sight (cuDNN's benchmark mode picks its
    # kernels): the warm-up runs one batch of each shape before anything is timed.
    per_shape: ClassVar[bool] = False
    # On, the samples come out of the loader other than ``dataset[i]`` makes them (JPEGs decoded
    # at reduced scale, decoded on the device): the guard reads its validation samples through the
    # configuration's own path (autotune.trial.build.read_samples), so it judges what changed.
    reads_samples: ClassVar[bool] = False
    # On, the speed measured holds only where the same samples are read again (repeated passes):
    # what the knob keeps, in the claim's words ("a cache of decoded samples").
    pays_on_repeats: ClassVar[str | None] = None
    # On, what the claim adds about what was measured: (its entry in the claim, the entry's
    # words, the sentence's few words), e.g. JPEG files decoded at reduced scale.
    claim_note: ClassVar[tuple[str, str, str] | None] = None

    def offer(self, ctx: SpaceContext) -> Offer:
        """Values this knob can take on ``ctx.env`` for ``ctx.data``."""
        return Offer(list(self.choices))

    def baseline(self, ctx: SpaceContext) -> Any:
        """The value of the untuned pipeline, the reference of every speedup."""
        return self.default

    def applies(self, config: dict[str, Any]) -> bool:
        """Whether the knob matters given the other values in ``config``."""
        return True

    def validate(self, value: Any) -> Any:
        """Return ``value`` in canonical form, or raise :class:`ConfigError`."""
        for choice in self.choices:
            if value == choice and type(value) is type(choice):
                return choice
        known = ", ".join(json.dumps(c) for c in self.choices)
        raise ConfigError(f"Knob {self.name!r} cannot be {value!r}. Known values: {known}.")

    def parse(self, text: str) -> Any:
        """Parse a value given on the command line (``--fix name=value``)."""
        text = text.strip()
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        if isinstance(value, str) and value.lower() in ("true", "false"):
            value = value.lower() == "true"
        return self.validate(value)

    def apply(self, state: BuildState, value: Any) -> None:
        """Change ``state`` so that the built pipeline has this knob at ``value``."""
        raise NotImplementedError

    def activate(self, value: Any) -> None:
        """Turn on the process-wide setting this knob stands for (a ``Stage.RUNTIME`` knob whose
        :meth:`apply` records ``state.settings[name] = value``). It runs inside a block that
        restores every process-wide setting afterwards (:func:`autotune.trial.build.settings_active`)."""


REGISTRY: dict[str, Knob] = {}


def register(cls: type[Knob]) -> type[Knob]:
    """Class decorator: add a knob to the registry under its name."""
    if cls.name in REGISTRY:
        raise ValueError(f"Knob {cls.name!r} is registered twice.")
    REGISTRY[cls.name] = cls()
    return cls


def get_knob(name: str) -> Knob:
    """The registered knob called ``name``.

    Raises:
        ConfigError: no knob has that name; the message lists the known ones.
    """
    try:
        return REGISTRY[name]
    except KeyError:
        raise ConfigError(f"No knob named {name!r}. Known: {', '.join(REGISTRY)}.") from None
