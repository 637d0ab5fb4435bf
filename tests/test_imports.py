"""No module of alignment/ imports one that imports it back, directly or through others (issue 11's done-when).

The graph is read from the source with `ast`, so it counts every import wherever it stands: at the top of a
module and inside a function (a deferred import is still a dependency, only a later one), `import alignment.x`,
`from alignment import x`, `from alignment.x import y` and relative imports alike. `alignment/__init__.py` is
left out: it is the package itself, which every `alignment.x` import runs first.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "alignment"


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The modules of alignment/ (by their short name) that the file at `path` imports anywhere in it."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "alignment" and len(parts) > 1:
                    found.add(parts[1])
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x, from .x import y (every module sits in alignment/ itself)
                base = node.module.split(".")[0] if node.module else None
            elif node.module and node.module.split(".")[0] == "alignment":
                base = node.module.split(".")[1] if "." in node.module else None
            else:
                continue
            if base is not None:
                found.add(base)
            else:  # from alignment import x, y (or from . import x): each name may be a module
                found |= {alias.name for alias in node.names}
    return found & modules


def import_graph() -> dict[str, set[str]]:
    modules = {path.stem for path in PACKAGE.glob("*.py") if path.stem != "__init__"}
    return {name: imported_modules(PACKAGE / f"{name}.py", modules) - {name} for name in sorted(modules)}


def tangled_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """Each group of two or more modules that reach each other through imports (Tarjan's strongly connected
    components): every import cycle lies inside one of them."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in graph:
        if node not in index:
            visit(node)
    return groups


def described(graph: dict[str, set[str]], group: set[str]) -> str:
    """A group as the failure names it: its shortest cycle, then every import inside it (the ones to break)."""
    inside = [f"{a} -> {b}" for a in sorted(group) for b in sorted(graph[a] & group)]
    return f"{' -> '.join(shortest_cycle(graph, group))} (imports among {', '.join(sorted(group))}: {', '.join(inside)})"


def shortest_cycle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """The shortest import path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths, seen = [[start]], {start}
    while paths:
        path = paths.pop(0)
        for other in sorted(graph[path[-1]] & group):
            if other == start:
                return path + [start]
            if other not in seen:
                seen.add(other)
                paths.append(path + [other])
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def test_the_cycle_finder_finds_a_cycle_and_reads_every_form_of_import(tmp_path):
    """The checker itself can fail: a made-up package with each form of import, one of them a cycle."""
    files = {"a": "from alignment.b import thing\n", "b": "def f():\n    from alignment import c\n",
             "c": "from . import a\n", "d": "import alignment.a\nfrom .a import thing\n", "e": "import os\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.py").write_text(text)
    names = set(files)
    graph = {name: imported_modules(tmp_path / f"{name}.py", names) - {name} for name in sorted(names)}
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert tangled_groups(graph) == [{"a", "b", "c"}]
    assert described(graph, {"a", "b", "c"}) == "a -> b -> c -> a (imports among a, b, c: a -> b, b -> c, c -> a)"


def test_no_module_of_alignment_imports_one_that_imports_it_back():
    graph = import_graph()
    found = tangled_groups(graph)
    assert not found, "import cycles in alignment/: " + "; ".join(described(graph, group) for group in found)


def test_the_flag_definitions_import_nothing_of_the_models():
    """args.py is read before any model loads (--help, a bad flag): it never reaches torch-loading code."""
    graph, reached, todo = import_graph(), set(), ["args"]
    while todo:
        for other in graph[todo.pop()] - reached:
            reached.add(other)
            todo.append(other)
    model_code = {"models", "lora", "tokens", "sampling", "head"}
    assert not reached & model_code, f"alignment.args reaches {sorted(reached & model_code)} (all it reaches: {sorted(reached)})"


def test_the_flags_parse_without_torch():
    """--help and a bad flag answer at once: reading the flags (and a recipe) imports no torch, which took 4.5 s of
    every parse through grpo's LOSS_TYPES (2026-12-07)."""
    import subprocess
    import sys
    code = ("import sys; from alignment.args import RLArgs, SFTArgs, EvalArgs, parse; [parse(c, []) for c in (RLArgs, SFTArgs, EvalArgs)]; "
            "print(sorted(m for m in ('torch', 'transformers', 'peft', 'vllm') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr


def test_the_scripts_answer_help_and_a_bad_flag_before_torch_loads():
    """`-m alignment.<script> --help` and a bad flag: each script parses its flags before its own imports of torch,
    transformers and peft (9-10 s of every --help, the 2026-12-07 probe round's find). torch is made unimportable,
    so a script that imports it before parsing ends in an ImportError instead of its usage."""
    import subprocess
    import sys
    blocked = "import sys, runpy; sys.modules.update(dict.fromkeys(('torch', 'transformers', 'peft', 'vllm')))"
    for script in ("train_rl", "sft", "evaluate", "expert_iteration"):
        for flags, status, said in ((["--help"], 0, "usage:"), (["--no_such_flag"], 2, "no_such_flag")):
            code = f"{blocked}; sys.argv = ['-m', *{flags!r}]; runpy.run_module('alignment.{script}', run_name='__main__')"
            done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == status and said in done.stdout + done.stderr, (script, flags, done.stderr[-2000:])
            if status:
                assert len(done.stderr.strip().splitlines()) == 1, (script, done.stderr)


def test_the_drivers_answer_help_and_a_bad_flag_before_torch_loads():
    """The bench drivers read their flags, write a card and refuse a bad command without torch: `gsm8k_card.py
    --card` on a missing folder took 10 s of imports (steps_demo reached torch through alignment.run, the card
    through calculator's tir), the stages load it in their own processes."""
    import subprocess
    import sys
    blocked = "import sys, runpy; sys.modules.update(dict.fromkeys(('torch', 'transformers', 'peft', 'vllm')))"
    for driver in ("gsm8k_card", "steps_demo", "tir_demo", "delethink_demo"):
        for flags, status, said in ((["--help"], 0, "usage:"), (["--no_such_flag"], 2, "no_such_flag")):
            code = (f"{blocked}; sys.path.insert(0, 'bench'); sys.argv = ['bench/{driver}.py', *{flags!r}]; "
                    f"runpy.run_path('bench/{driver}.py', run_name='__main__')")
            done = subprocess.run([sys.executable, "-c", code], cwd=PACKAGE.parent, capture_output=True, text=True,
                                  timeout=120)
            assert done.returncode == status and said in done.stdout + done.stderr, (driver, flags, done.stderr[-2000:])
