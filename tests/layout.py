"""The import-graph check the layout tests share (tests/test_package.py for autotune/,
tests/test_benchmarks.py for benchmarks/)."""


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """An import circle in ``graph`` (module -> the modules it imports) as the modules along it,
    first and last the same, or ``None``: a depth-first search, imports inside functions
    included as the graph has them.

    Example:
        >>> find_cycle({"a": {"b"}, "b": {"a"}}), find_cycle({"a": {"b"}, "b": set()})
        (['a', 'b', 'a'], None)
    """
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                return [*path, module, dep]
            if dep not in state and (cycle := visit(dep, [*path, module])):
                return cycle
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [])):
            return cycle[cycle.index(cycle[-1]) :]
    return None
