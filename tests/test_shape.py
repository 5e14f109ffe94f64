"""The package's shape, as the split by audience promises it: no import circle among minirl's modules
(imports inside functions included), importing the loops loads none of the tools, each loop's longest
function is at most 100 lines, no module is over 450 lines, and the only folder is minirl/tools/."""

import ast
import os
import subprocess
import sys

from conftest import ROOT

PKG = os.path.join(ROOT, "minirl")


def modules() -> dict[str, str]:
    out = {}
    for d, subs, files in os.walk(PKG):
        subs[:] = [s for s in subs if s != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                name = os.path.relpath(os.path.join(d, f), ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = os.path.join(d, f)
    return out


def imports(name: str, path: str, known: set) -> set:
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("minirl"):
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m in known and m not in (name, "minirl")}


def test_no_import_circle_even_through_imports_inside_functions():
    mods = modules()
    graph = {m: imports(m, p, set(mods)) for m, p in mods.items()}

    def reaches(start, seen):
        for m in graph[start]:
            if m not in seen:
                seen.add(m)
                reaches(m, seen)
        return seen
    circles = sorted(m for m in graph if m in reaches(m, set()))
    assert circles == []


def test_importing_the_loops_loads_no_tool():
    code = "import sys, minirl.grpo, minirl.ppo; print([m for m in sys.modules if m.startswith('minirl.tools')])"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_loops_fit_a_scroll_and_every_module_a_sitting():
    for loop in ("grpo", "ppo"):
        tree = ast.parse(open(os.path.join(PKG, f"{loop}.py")).read())
        longest = max(n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
        assert longest <= 100, (loop, longest)
    sizes = {p: sum(1 for _ in open(p)) for p in modules().values()}
    assert [p for p, n in sizes.items() if n > 450] == []
    assert {os.path.dirname(p) for p in sizes} == {PKG, os.path.join(PKG, "tools")}
