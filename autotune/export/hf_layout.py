"""The winner of a Hugging Face model in the folder its users' libraries load: ``hf/`` beside
the artifacts, with the model's ``config.json`` and tokenizer, the ONNX graph as ``model.onnx``
and the OpenVINO IR as ``openvino_model.xml``.

``optimum.onnxruntime.ORTModelFor...`` and ``optimum.intel.OVModelFor...`` then load it with
``from_pretrained(out / "hf")``. A sentence-transformers model's folder also holds its own
modules (``modules.json``, the pooling and normalisation configs) as ``SentenceTransformer.save``
writes them, so ``SentenceTransformer(out / "hf", backend="onnx")`` (or ``"openvino"``) runs the
winner's graph and pools its token embeddings as the model did. The files are the shipped
artifacts themselves (hard links where the disk allows), or, where the libraries need the token
embeddings named ``last_hidden_state``, a copy with that output renamed (optimum-intel's
feature-extraction class refuses a graph whose outputs keep both of Sentence Transformers' names).

Example:
    >>> import tempfile, torch
    >>> from pathlib import Path
    >>> write_hf_layout(torch.nn.Linear(2, 2), None, Path(tempfile.mkdtemp()), {})  # no transformers model
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from typing import Any

__all__ = ["FOLDER", "GRAPH_FILES", "write_hf_layout"]

FOLDER = "hf"
# The file names optimum's classes (and Sentence Transformers through them) look for.
GRAPH_FILES = {"onnx": "model.onnx", "openvino": "openvino_model.xml"}
HIDDEN = "last_hidden_state"  # the output optimum's feature-extraction classes read
TOKENS = "token_embeddings"  # a sentence-transformers model's name for it
# The weights SentenceTransformer.save writes beside its config: the untuned model's, which the
# folder does not ship (the graphs are the winner).
_WEIGHTS = ("model.safetensors", "model-*-of-*.safetensors", "*.index.json", "pytorch_model*.bin")


def _link(src: Path, dest: Path) -> None:
    """``dest`` as a second name of ``src`` where the disk allows, else a copy."""
    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def _onnx_named(src: Path, dest: Path, source: str) -> None:
    """``src`` with its output ``source`` renamed ``last_hidden_state``."""
    import onnx

    proto = onnx.load(str(src))
    output = next(o for o in proto.graph.output if o.name == source)
    proto.graph.node.append(onnx.helper.make_node("Identity", [source], [HIDDEN], name=f"{HIDDEN}_of_{source}"))
    output.name = HIDDEN  # the graph's output is now the Identity's; ``source`` stays inside
    onnx.save(proto, str(dest))


def _openvino_named(src: Path, dest: Path, source: str) -> None:
    """``src`` (its IR) with its output tensor ``source`` renamed ``last_hidden_state``."""
    import openvino as ov

    model = ov.Core().read_model(str(src))
    for output in model.outputs:
        if source in output.get_names():
            output.get_tensor().set_names({HIDDEN})
    ov.save_model(model, str(dest), compress_to_fp16=False)  # its weights as they are


def _write_graph(fmt: str, src: Path, folder: Path, source: str | None) -> Path:
    """The artifact ``src`` as ``folder``'s graph file, its ``source`` output renamed ``last_hidden_state``."""
    dest = folder / GRAPH_FILES[fmt]
    if source is None:
        _link(src, dest)
        if fmt == "openvino":
            _link(src.with_suffix(".bin"), dest.with_suffix(".bin"))
    elif fmt == "onnx":
        _onnx_named(src, dest, source)
    else:
        _openvino_named(src, dest, source)
    return dest


def _renamed(found: Any, names: list[str]) -> tuple[str | None, str | None]:
    """Which output the folder's graph names ``last_hidden_state`` (``None``: none needs it),
    or why the graph cannot go in the folder."""
    if HIDDEN in names or found.own_outputs:
        return None, None
    if found.sentence is not None and TOKENS in names:
        return TOKENS, None
    return None, (
        f"the graph's outputs ({', '.join(names) or 'unnamed'}) are not the transformers model's own, which "
        "its libraries read: pass the transformers model itself, or a SentenceTransformer"
    )


def _write_model_files(found: Any, collate_fn: Any, folder: Path) -> bool:
    """``config.json``, the tokenizer and, for a sentence-transformers model, its modules; whether
    a tokenizer was written."""
    from autotune.export.hf import tokenizer_of

    if found.sentence is not None:
        found.sentence.save(str(folder), create_model_card=False)
        for pattern in _WEIGHTS:
            for path in folder.glob(pattern):
                path.unlink()
        return (folder / "tokenizer_config.json").is_file()
    config = copy.deepcopy(found.pretrained.config)
    config.architectures = [type(found.pretrained).__name__]  # as the model's own save_pretrained writes it
    config.save_pretrained(str(folder))
    tokenizer = tokenizer_of(collate_fn, found.pretrained)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(folder))
    return tokenizer is not None


def write_hf_layout(model: Any, collate_fn: Any, out_dir: Path, artifacts: dict[str, dict[str, Any]]) -> None:
    """Write ``out_dir/hf`` for the ONNX and OpenVINO artifacts that passed their checks, when
    ``model`` is or holds a Hugging Face model (:func:`autotune.export.hf.find_hf`); an earlier
    folder is removed first. Never raises: each artifact's record gets ``"hf"``, either
    ``{"path", "tokenizer", "sentence_transformers"}`` (the graph's file, relative to
    ``out_dir``; whether the folder has a tokenizer and Sentence Transformers' modules) or
    ``{"error"}`` (why it has no place in the folder).

    Args:
        model: The user's model, untouched (its config and modules are saved, not its weights).
        collate_fn: The run's collate; its ``tokenizer`` is saved when it has one.
        out_dir: The run's folder, where the artifacts are.
        artifacts: ``{format: record}`` as :func:`autotune.runtimes.artifacts.export_artifacts` returns it.
    """
    from autotune.export.hf import find_hf
    from autotune.export.parity import describe_error

    out = Path(out_dir)
    folder = out / FOLDER
    shutil.rmtree(folder, ignore_errors=True)
    found = find_hf(model)
    shipped = [f for f in GRAPH_FILES if (artifacts.get(f) or {}).get("status") == "ok"]
    if found is None or not shipped:
        return
    named = {}
    for fmt in shipped:
        source, why = _renamed(found, list(artifacts[fmt].get("output_names") or []))
        if why is None:
            named[fmt] = source
        else:
            artifacts[fmt]["hf"] = {"error": why}
    if not named:
        return
    try:
        folder.mkdir(parents=True)
        tokenizer = _write_model_files(found, collate_fn, folder)
        for fmt, source in named.items():
            dest = _write_graph(fmt, out / artifacts[fmt]["path"], folder, source)
            artifacts[fmt]["hf"] = {
                "path": dest.relative_to(out).as_posix(),
                "tokenizer": tokenizer,
                "sentence_transformers": found.sentence is not None,
            }
    except Exception as exc:  # the artifacts stand without the folder
        shutil.rmtree(folder, ignore_errors=True)
        for fmt in named:
            artifacts[fmt]["hf"] = {"error": f"the Hugging Face folder could not be written: {describe_error(exc)}"}
