"""The documentation runs and is complete.

- Every ```python block in docs/ and README.md runs: the blocks of one file in order, in one
  fresh interpreter (as a reader pastes them into one script), in an empty working directory.
  A block preceded by ``<!-- skip: why -->`` is not run; it is reported as a skipped test.
- docs/cli.md documents every subcommand and long flag of the real parser, and every flag a page
  names exists under that name: in cli.md's sections, in any ``autotune CMD ...`` command line,
  and in any inline code span (benchmark scripts' flags checked against their sources). The
  ``autotune run`` synopses of the README and cli.md, and cfg.md's precedence table, list every
  flag of its parser.
- docs/api.md's signatures are the functions' own, its tables name only real keywords and
  ``Result`` attributes; cfg.md's names are the ones cfg.py may define.
- docs/knobs/ has an entry for every registered knob, listing every value it knows, and the
  README's knob table has a row for every knob.
- docs/README.md links every page, and every relative link (and its #anchor) resolves: no page
  is exempt.
- Install lines name this project's distribution and its real extras, never the unrelated
  ``autotune`` on PyPI; the README's user install pulls no contributor extra, and its table of
  extras names every requirement of each (the core's too).
"""

import argparse
import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.rglob("*.md"))
FILES = [*PAGES, ROOT / "README.md"]

_FENCE = re.compile(r"^([ \t]*)```python[ \t]*\n(.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)
_SKIP = re.compile(r"<!--\s*skip:\s*(.+?)\s*-->\s*$")
_TIMEOUT_S = 300


@dataclasses.dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the first code line, 1-based
    code: str
    skip: str | None

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in _FENCE.finditer(text):
        indent, body = match.group(1), match.group(2)
        code = "".join(line[len(indent) :] if line.startswith(indent) else line for line in body.splitlines(True))
        before = text[: match.start()].rstrip().splitlines()
        skip = _SKIP.search(before[-1]) if before else None
        line = text.count("\n", 0, match.start()) + 2
        found.append(Block(path, line, code, skip.group(1) if skip else None))
    return found


ALL_BLOCKS = [b for f in FILES for b in _blocks(f)]
RUN_FILES = sorted({b.path for b in ALL_BLOCKS if b.skip is None})
SKIPPED = [b for b in ALL_BLOCKS if b.skip is not None]

# Runs blocks given as JSON [[filename, first line, code], ...] in one namespace. Each block is
# compiled with its file's name and line numbers, so a traceback points into the page.
_DRIVER = """
import json, sys
namespace = {"__name__": "__main__"}
for filename, line, code in json.load(sys.stdin):
    exec(compile("\\n" * (line - 1) + code, filename, "exec"), namespace)
"""


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


# Pages whose blocks run whole studies for a minute or more on 2 cores: they run with -m slow.
# The quickstart's study itself runs in CI through tests/test_examples.py (its cfg.py, the CLI).
SLOW_PAGES = {"docs/api.md", "docs/training.md", "docs/quickstart.md"}
RUN_PARAMS = [pytest.param(p, marks=pytest.mark.slow) if _rel(p) in SLOW_PAGES else p for p in RUN_FILES]


@pytest.mark.parametrize("path", RUN_PARAMS, ids=_rel)
def test_code_blocks_run(path, tmp_path):
    blocks = [[_rel(b.path), b.line, b.code] for b in _blocks(path) if b.skip is None]
    done = subprocess.run(
        [sys.executable, "-c", _DRIVER],
        input=json.dumps(blocks),
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=_TIMEOUT_S,
    )
    assert done.returncode == 0, f"a code block of {_rel(path)} failed:\n{done.stderr[-4000:]}"


@pytest.mark.parametrize("block", SKIPPED, ids=lambda b: b.where)
def test_skipped_block(block):
    pytest.skip(f"{block.where}: {block.skip}")


def test_skip_markers_and_indented_blocks_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "intro\n\n<!-- skip: needs CUDA -->\n```python\nimport torch\n```\n\n"
        "1. a step:\n\n   ```python\n   x = 1\n   ```\n"
    )
    blocks = _blocks(page)
    assert [(b.skip, b.code, b.line) for b in blocks] == [("needs CUDA", "import torch\n", 5), (None, "x = 1\n", 11)]


# --- the CLI reference -------------------------------------------------------------------------


def _commands() -> dict[str, list[str]]:
    """Every subcommand of the real parser with its documented long flags."""
    from autotune.cli import _parser

    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    commands = {}
    for name, command in sub.choices.items():
        commands[name] = [
            flag
            for action in command._actions
            if action.help != argparse.SUPPRESS
            for flag in action.option_strings
            if flag.startswith("--") and flag != "--help"
        ]
    return commands


def _sections(text: str, level: str) -> dict[str, str]:
    """Heading text -> the text under it, for headings of exactly ``level`` (``"##"``)."""
    parts = re.split(rf"^{level} +(.+?)\s*$", text, flags=re.MULTILINE)
    return {parts[i].strip(): parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def test_cli_reference_documents_every_command_and_flag():
    sections = _sections((DOCS / "cli.md").read_text(), "##")
    missing = []
    for name, flags in _commands().items():
        body = sections.get(f"`autotune {name}`")
        if body is None:
            missing.append(f"section ## `autotune {name}`")
            continue
        missing += [f"{name} {flag}" for flag in flags if not re.search(rf"`{re.escape(flag)}\b", body)]
    assert not missing, f"docs/cli.md lacks: {', '.join(missing)}"


# --- the Python API reference ------------------------------------------------------------------

_API = ("optimize", "plan", "apply", "dataloader", "training", "load", "verify", "load_config")


def test_api_reference_names_every_parameter_and_result_field():
    import dataclasses as dc
    import inspect

    import autotune

    sections = _sections((DOCS / "api.md").read_text(), "##")
    missing = []
    for name in _API:
        body = sections.get(f"`autotune.{name}`")
        if body is None:
            missing.append(f"section ## `autotune.{name}`")
            continue
        for param in inspect.signature(getattr(autotune, name)).parameters.values():
            if param.kind is param.VAR_KEYWORD:
                param_name = f"**{param.name}"
            else:
                param_name = param.name
            if not re.search(rf"(?<![\w]){re.escape(param_name)}\b", body):
                missing.append(f"{name}({param_name})")
    result = sections.get("`autotune.Result`", "")
    missing += [f"Result.{f.name}" for f in dc.fields(autotune.Result) if f"`{f.name}`" not in result]
    unlisted = [n for n in autotune.__all__ if n != "__version__" and f"`{n}`" not in (DOCS / "api.md").read_text()]
    assert not missing and not unlisted, f"docs/api.md lacks: {', '.join(missing + unlisted)}"


# --- the knob reference ------------------------------------------------------------------------


def _knob_sections() -> dict[str, tuple[Path, str]]:
    found = {}
    for page in sorted((DOCS / "knobs").glob("*.md")):
        for heading, body in _sections(page.read_text(), "##").items():
            name = re.fullmatch(r"`(\w+)`", heading)
            if name:
                found[name.group(1)] = (page, body)
    return found


def _spelled(value) -> str:
    return json.dumps(value).strip('"')


def test_every_knob_has_a_reference_entry_with_its_values():
    from autotune.knobs import REGISTRY

    sections = _knob_sections()
    missing = [name for name in REGISTRY if name not in sections]
    assert not missing, f"docs/knobs/*.md has no '## `name`' entry for: {', '.join(missing)}"
    unlisted = []
    for name, knob in REGISTRY.items():
        body = sections[name][1]
        for value in knob.choices:
            if not re.search(rf"`{re.escape(_spelled(value))}`", body):
                unlisted.append(f"{name}={_spelled(value)}")
    assert not unlisted, f"knob values missing from their entries: {', '.join(unlisted)}"
    extra = [name for name in sections if name not in REGISTRY]
    assert not extra, f"docs/knobs/ documents knobs that do not exist: {', '.join(extra)}"


def test_the_knob_index_has_a_row_for_every_knob():
    from autotune.knobs import REGISTRY

    rows = re.findall(r"^\| `(\w+)` \|", (DOCS / "knobs" / "README.md").read_text(), re.M)
    assert sorted(rows) == sorted(REGISTRY), f"docs/knobs/README.md rows {rows} != knobs {list(REGISTRY)}"


# --- the index and the links -------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
_LINK_ANCHOR = re.compile(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as ``-``."""
    text = re.sub(r"^[ \t]*```.*?^[ \t]*```", "", page.read_text(), flags=re.MULTILINE | re.DOTALL)
    headings = re.findall(r"^#{1,6} +(.+?)\s*$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_index_links_every_page():
    index = (DOCS / "README.md").read_text()
    linked = {(DOCS / target).resolve() for target in _LINK.findall(index)}
    unlinked = [_rel(p) for p in PAGES if p.name != "README.md" and p.resolve() not in linked]
    assert not unlinked, f"docs/README.md does not link: {', '.join(unlinked)}"


def test_relative_links_and_their_anchors_resolve():
    broken = []
    for page in FILES:
        for target, anchor in _LINK_ANCHOR.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (page.parent / target).resolve() if target else page
            if not path.exists():
                broken.append(f"{_rel(page)} -> {target}")
            elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
                broken.append(f"{_rel(page)} -> {target}#{anchor}")
    assert not broken, f"broken links: {', '.join(broken)}"


def _readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return " ".join(text[start : end if end != -1 else None].split())


def test_readme_measurement_paragraph_matches_the_claims_code():
    """The README's "How it measures" states what claims.py does, with its constants."""
    from autotune.run import claims
    from autotune.run.rounds import SELECT_GAIN
    from autotune.search.select import FINALIST_SHARE

    text = _readme_section("How it measures")
    assert f"{claims.LEVEL:.0%} interval" in text
    assert f"within +-{claims.TARGET_HALF_WIDTH:.0%}" in text
    assert f"wider than +-{claims.MAX_CLAIM_WIDTH:.0%}" in text
    assert "geometric mean" in text and "Student-t" in text
    assert f"split over {claims.CONFIRM_PROCESSES} fresh worker processes" in text
    # The selection: finalists near the fastest trial, timed against it, which a finalist
    # displaces only by the margin run/rounds.py holds (not a ratio to the baseline).
    assert f"within {1 - FINALIST_SHARE:.0%} of the fastest" in text
    assert f"at least {SELECT_GAIN - 1:.0%} faster" in text and "the baseline is not timed here" in text
    for verdict in ("includes 1.0", "below 1.0"):
        assert verdict in text
    # What an earlier version of the protocol did, and the code no longer does.
    for stale in ("median of baseline/best pair ratios", "fastest on re-measurement", "best ratio to the baseline"):
        assert stale not in text
    # Fidelity is judged per output kind, not by relative error alone.
    assert "relative error for other outputs" not in (ROOT / "README.md").read_text()


# --- every option the docs name exists under that name ------------------------------------------


def _all_flags() -> dict[str, set[str]]:
    """Every subcommand of the real parser with all its long flags (hidden ones included)."""
    from autotune.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {
        name: {f for action in command._actions for f in action.option_strings if f.startswith("--")}
        for name, command in sub.choices.items()
    }


_FLAG = re.compile(r"(?<![\w-])--[a-z][\w-]*")
_FENCED = re.compile(r"^[ \t]*```[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
# Other tools' flags that pages name in passing: docker, tensorboard, srun, pip, kubectl.
_FOREIGN = {"--cpus", "--logdir", "--kill-on-bad-exit", "--gpus-per-node", "--index-url", "--no-deps", "--from-file"}


def _command_lines(text: str) -> list[str]:
    """Shell commands of a page: each code block's lines with their continuations (a trailing
    backslash, or a next line that starts with ``[`` or ``--``), split at ``&&``, ``|`` and
    ``;``, and every inline code span."""
    commands = []
    for block in _FENCED.findall(text):
        joined: list[str] = []
        for line in block.splitlines():
            if joined and (joined[-1].endswith("\\") or re.match(r"\s+(\[|--)", line)):
                joined[-1] = joined[-1].rstrip("\\") + " " + line.strip()
            else:
                joined.append(line)
        commands += joined
    commands += re.findall(r"`([^`\n]+)`", _FENCED.sub("", text))
    return [part for line in commands for part in re.split(r"&&|\|\||[|;]", line)]


def _benchmark_source(module: str) -> str:
    """The source of ``python -m benchmarks.<module>``: its file, or for a family's folder
    (``benchmarks.text``) the module whose ``main`` its ``__main__.py`` runs."""
    path = ROOT / "benchmarks" / Path(*module.split("."))
    if path.is_dir():
        entry = re.search(r"from benchmarks\.([\w.]+) import main", (path / "__main__.py").read_text())
        path = ROOT / "benchmarks" / Path(*entry.group(1).split("."))
    return path.with_suffix(".py").read_text()


def test_every_flag_in_a_command_line_exists_for_its_command():
    flags = _all_flags()
    wrong = []
    for page in FILES:
        for command in _command_lines(page.read_text()):
            found = re.search(r"(?:^|\s|\()autotune +([a-z]+)\b(.*)", command)
            if found and found.group(1) in flags:
                wrong += [
                    f"{_rel(page)}: autotune {found.group(1)} {flag}"
                    for flag in _FLAG.findall(found.group(2))
                    if flag not in flags[found.group(1)]
                ]
            script = re.search(r"python -m benchmarks\.(\w+(?:\.\w+)*)(.*)", command)
            if script:
                source = _benchmark_source(script.group(1))
                wrong += [
                    f"{_rel(page)}: benchmarks.{script.group(1)} {flag}"
                    for flag in _FLAG.findall(script.group(2))
                    if f'"{flag}"' not in source
                ]
    assert not wrong, f"flags the code lacks: {', '.join(sorted(set(wrong)))}"


def _top_flags() -> set[str]:
    """The long flags of ``autotune`` itself, before any command (``--version``)."""
    from autotune.cli import _parser

    return {f for action in _parser()._actions for f in action.option_strings if f.startswith("--")}


def test_every_flag_a_page_names_exists():
    known = set().union(*_all_flags().values()) | _top_flags() | _FOREIGN
    for source in (ROOT / "benchmarks").rglob("*.py"):
        known |= set(re.findall(r"[\"'](--[a-z][\w-]*)[\"'=]", source.read_text()))
    unknown = set()
    for page in FILES:
        for span in re.findall(r"`([^`\n]+)`", _FENCED.sub("", page.read_text())):
            unknown |= {f"{_rel(page)}: {flag}" for flag in _FLAG.findall(span) if flag not in known}
    assert not unknown, f"flags no command has: {', '.join(sorted(unknown))}"


def test_cli_reference_sections_name_only_their_commands_flags():
    flags = _all_flags()
    sections = _sections((DOCS / "cli.md").read_text(), "##")
    wrong = []
    for name, body in sections.items():
        command = re.fullmatch(r"`autotune (\w+)`", name)
        assert command and command.group(1) in flags, f"docs/cli.md has a section for no command: {name}"
        for flag in set(_FLAG.findall(body)) - flags[command.group(1)]:
            # Another command's flag may be named as such ("`autotune run --no-profile`").
            if not re.search(rf"autotune \w+ [^`\n]*{re.escape(flag)}", body):
                wrong.append(f"{command.group(1)} {flag}")
    assert not wrong, f"docs/cli.md names flags its command lacks: {', '.join(sorted(wrong))}"


def test_every_command_is_in_both_command_lists():
    commands = _all_flags()
    readme = (ROOT / "README.md").read_text()
    listing = _FENCED.findall(readme[readme.index("## Command line") :])[0]
    cli_listing = _FENCED.findall((DOCS / "cli.md").read_text())[0]
    for where, text in (("README.md", listing), ("docs/cli.md", cli_listing)):
        listed = set(re.findall(r"^autotune (\w+)", text, re.MULTILINE))
        assert listed == set(commands), f"{where}'s command list: {sorted(listed)} != {sorted(commands)}"


def _run_flags() -> list[str]:
    """Every long flag of ``autotune run``, read from the parser the command builds, so a flag
    added there without docs fails the tests below."""
    from autotune.cli.run import _run_parser

    parser = argparse.ArgumentParser()
    _run_parser(parser)
    return [
        flag
        for action in parser._actions
        if action.help != argparse.SUPPRESS
        for flag in action.option_strings
        if flag.startswith("--") and flag != "--help"
    ]


def _run_synopsis(block: str) -> str:
    """The ``autotune run`` lines of a listing: its first line and the indented ones under it."""
    lines = block.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("autotune run "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
    return "\n".join(lines[start:end])


def test_run_synopses_list_every_flag_of_autotune_run():
    readme = (ROOT / "README.md").read_text()
    synopses = {
        "README.md": _run_synopsis(_FENCED.findall(readme[readme.index("## Command line") :])[0]),
        "docs/cli.md": _run_synopsis(
            _FENCED.findall(_sections((DOCS / "cli.md").read_text(), "##")["`autotune run`"])[0]
        ),
    }
    missing = [
        f"{where}: {flag}"
        for where, text in synopses.items()
        for flag in _run_flags()
        if not re.search(rf"\[{re.escape(flag)}(?![\w-])", text)
    ]
    assert not missing, f"autotune run's synopsis lacks: {', '.join(missing)}"


# Flags that shape only what a run prints, not what it does: the cfg.py has no option for them.
_OUTPUT_FLAGS = {"--dry-run", "--quiet", "--verbose", "--json", "--debug"}


def test_cfg_precedence_table_maps_every_flag_of_autotune_run():
    sections = _sections((DOCS / "cfg.md").read_text(), "##")
    rows = re.findall(r"^\| (`--.+?) \| (`.+?) \|$", sections["Precedence"], re.MULTILINE)
    mapped = {flag for flags, _ in rows for flag in _FLAG.findall(flags)}
    missing = sorted(set(_run_flags()) - _OUTPUT_FLAGS - mapped)
    assert not missing, f"docs/cfg.md's precedence table lacks: {', '.join(missing)}"


def test_cli_help_and_reference_agree_on_what_the_timeout_bounds():
    from autotune.cli import _parser

    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    run = {f: a for a in sub.choices["run"]._actions for f in a.option_strings}
    row = re.search(r"^\| `--timeout S` \|([^|]+)\|", (DOCS / "cli.md").read_text(), re.MULTILINE).group(1)
    assert "whole run" in run["--timeout"].help and "whole run" in row
    # Where the help states a default, the reference's row states the same.
    rows = dict(
        re.findall(
            r"^\| `(--[\w-]+)[^`]*` \|(.+)$", _sections((DOCS / "cli.md").read_text(), "##")["`autotune run`"], re.M
        )
    )
    differ = []
    for flag, action in run.items():
        stated = re.search(r"\(default:? ([^),;]+)", action.help or "")
        if stated and flag in rows and stated.group(1).split()[0].strip("'") not in rows[flag]:
            differ.append(f"{flag}: help {stated.group(1)!r}, docs {rows[flag].strip()!r}")
    assert not differ, f"docs/cli.md and the help differ: {'; '.join(differ)}"


def _signature(body: str) -> list[str]:
    """The parameter names of the first ```text signature block of an API section."""
    text = " ".join(re.search(r"```text\n(.*?)```", body, re.DOTALL).group(1).split())
    params = re.match(r"\w+\((.*?)\)\s*(?:->.*)?$", text).group(1)
    return [p.split("=")[0].strip() for p in params.split(",") if p.strip() and p.strip() != "*"]


def test_api_signatures_are_the_functions_own_and_tables_name_real_options():
    import inspect

    import autotune

    text = (DOCS / "api.md").read_text()
    sections = _sections(text, "##")
    wrong = []
    for name in (*_API, "predict", "predictor", "profile", "collect"):
        real = [
            f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name
            for p in inspect.signature(getattr(autotune, name)).parameters.values()
        ]
        if _signature(sections[f"`autotune.{name}`"]) != real:
            wrong.append(f"{name}: {_signature(sections[f'`autotune.{name}`'])} != {real}")
    keywords = inspect.signature(autotune.optimize).parameters
    for table_name in re.findall(r"^\| `([^`]+)`", sections["`autotune.optimize`"], re.MULTILINE):
        wrong += [f"optimize table: {n}" for n in re.findall(r"\w+", table_name) if n not in keywords]
    result_fields = {f.name for f in dataclasses.fields(autotune.Result)}
    for row in re.findall(r"^\| (`.+?) \|", sections["`autotune.Result`"], re.MULTILINE):
        wrong += [f"Result table: {n}" for n in re.findall(r"`(\w+)`", row) if n not in result_fields]
    listed = re.search(r"The public names are in `autotune.__all__`:(.*?)\.\n", text, re.DOTALL).group(1)
    wrong += [
        f"not in the public names: {n}" for n in autotune.__all__ if n != "__version__" and f"`{n}`" not in listed
    ]
    assert not wrong, "; ".join(wrong)


def test_cfg_reference_names_what_a_cfg_may_define_and_real_flags():
    from autotune.run.options import CFG_OPTIONS, Options

    sections = _sections((DOCS / "cfg.md").read_text(), "##")
    names = re.findall(r"^\| `(\w+)` \|", sections["Names"], re.MULTILINE)
    assert sorted(names) == sorted({"model", "dataset", "options", *CFG_OPTIONS}), names
    run_flags = _all_flags()["run"]
    for flags, options in re.findall(r"^\| (`--.+?) \| (`.+?) \|$", sections["Precedence"], re.MULTILINE):
        assert set(_FLAG.findall(flags)) <= run_flags, flags
        assert {o.split("=")[0] for o in re.findall(r"`([\w=]+)", options)} <= set(Options.names()), options


def test_readme_knob_table_has_a_row_for_every_knob():
    from autotune.knobs import REGISTRY

    first_cells = re.findall(r"^\| (`\w+`(?:, `\w+`)*) \|", _readme_raw("Knobs"), re.MULTILINE)
    named = set(re.findall(r"`(\w+)`", " ".join(first_cells)))
    assert set(REGISTRY) <= named, f"README knob table lacks: {sorted(set(REGISTRY) - named)}"
    assert named <= set(REGISTRY), f"README knob table names knobs that do not exist: {sorted(named - set(REGISTRY))}"


def _readme_raw(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


# --- installing ------------------------------------------------------------------------------------


def _project() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the backport autotune requires there
        import tomli as tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_install_lines_name_this_distribution_and_its_real_extras():
    project = _project()
    extras = set(project["optional-dependencies"])
    wrong = []
    code = [*sorted((ROOT / "autotune").rglob("*.py")), *sorted((ROOT / "tests").rglob("*.py"))]
    sources = [*FILES, *(path for path in code if path != Path(__file__).resolve())]
    for path in sources:
        for line in path.read_text().splitlines():
            for name, wanted in re.findall(r"([\w.-]+)\[([\w,-]+)\]", line if "pip install" in line else ""):
                if name in (".", project["name"]):
                    wrong += [f"{_rel(path)}: no extra {e!r}" for e in wanted.split(",") if e not in extras]
                elif name == "autotune":
                    wrong.append(f"{_rel(path)}: {name}[{wanted}] is another project on PyPI")
            if re.search(r"pip install ['\"]?autotune\b(?!-)", line):
                wrong.append(f"{_rel(path)}: 'pip install autotune' installs another project")
    assert not wrong, "; ".join(wrong)


def _requirement_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9][\w.-]*", requirement).group(0)


def test_readme_extras_table_names_every_requirement_of_each_extra():
    """The table of extras lists what each installs, the core's included, so a new dependency
    without a word in the README fails here."""
    project = _project()
    rows = {}  # extra -> what its row says it brings; "(none)" is the core
    for cell, brings in re.findall(r"^\| ([^|]+?) \| ([^|]+) \|", _readme_raw("Install"), re.MULTILINE):
        for extra in re.findall(r"`([\w-]+)`", cell) or [cell]:
            rows[extra] = brings
    wanted = {"(none)": project["dependencies"], **project["optional-dependencies"]}
    missing = [f"the row of {extra}" for extra in wanted if extra not in rows]
    missing += [
        f"{extra}: {name}"
        for extra, requirements in wanted.items()
        for name in map(_requirement_name, requirements)
        if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", rows.get(extra, ""), re.IGNORECASE)
    ]
    assert not missing, f"the README's extras table lacks: {', '.join(missing)}"


def test_the_readme_user_install_is_cpu_torch_then_the_package_without_contributor_extras():
    blocks = _FENCED.findall(_readme_raw("The two commands"))
    assert len(blocks) == 2, "two commands: install and run the main job, run the tests"
    install, tests = (" ".join(b.split()) for b in blocks)
    assert "autotune run" in install and "pytest" in tests and '".[dev]"' in tests
    torch_at, package_at = install.index("pip install torch"), install.index("pip install -e ")
    assert torch_at < package_at, "torch first, or pip resolves it to PyPI's CUDA build"
    assert "--index-url https://download.pytorch.org/whl/cpu" in install[torch_at:package_at]
    # The user's extras: OpenVINO (it installs nothing off x86-64 Linux), no contributor's.
    extras = re.findall(r"\[([\w,-]+)\]", install[package_at:].split("&&")[0])
    assert all(set(e.split(",")) <= {"openvino"} for e in extras), extras


# --- the examples give what the model gives -----------------------------------------------------


def test_readme_mean_pooling_gives_unit_length_embeddings_like_the_model():
    """all-MiniLM-L6-v2 ends in a Normalize layer: SentenceTransformer.encode gives the masked
    mean of the last hidden state scaled to unit length. The README's wrapper must do the same."""
    import types

    import torch

    block = next(b for b in _blocks(ROOT / "README.md") if "class MeanPooled" in b.code).code
    source = block[block.index("class MeanPooled") : block.index("\nmodel = ")]
    namespace: dict = {"torch": torch}
    exec(source, namespace)
    hidden = torch.randn(3, 5, 8) * 4
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    encoder = lambda ids, attention, types_=None: types.SimpleNamespace(last_hidden_state=hidden)  # noqa: E731
    out = namespace["MeanPooled"](encoder)(torch.zeros(3, 5, dtype=torch.long), mask)
    keep = mask.unsqueeze(-1).float()
    expected = torch.nn.functional.normalize((hidden * keep).sum(1) / keep.sum(1), p=2, dim=1)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out.norm(dim=1), torch.ones(3))


# --- secrets -------------------------------------------------------------------------------------


def test_no_page_puts_a_database_password_in_a_url():
    """A password in a storage URL ends up on the command line (``ps``) or in a manifest: the
    pages pass it through the driver's environment (PGPASSWORD) or a secret instead."""
    found = []
    for page in FILES:
        for match in re.finditer(r"\b[a-z+]+://[^\s/:@'\"]+:([^\s@'\"/]+)@", page.read_text()):
            if match.group(1) != "***":  # how autotune writes a recorded URL
                found.append(f"{_rel(page)}: {match.group(0)}")
    assert not found, f"passwords in URLs: {', '.join(found)}"
