"""docs/invariants.md names only code and tests that exist: every `module.name` (a minirl module, flat or
under tools/, and an attribute path in it) and every `test_file.py::test_name` it cites, so a rule's row
cannot point at code a change moved or a test a change renamed; and every test, dotted flag and repository file
that the README and docs/ name exists."""

import ast
import importlib
import os
import re

from conftest import DOCS, ROOT

DOC = os.path.join(ROOT, "docs", "invariants.md")
MODULES = {name[:-3] for name in os.listdir(os.path.join(ROOT, "minirl")) if name.endswith(".py")} | {
    f"tools.{name[:-3]}" for name in os.listdir(os.path.join(ROOT, "minirl", "tools")) if name.endswith(".py")}


FLAGS = {"rl", "ppo", "minirl"}  # `rl.deterministic` is a flag group, `minirl.ppo` a command


def cited_code(text: str) -> list[str]:
    """`module.attr...` spans: a lower-case first part (not a flag group or a file name) is a module."""
    out = []
    for span in re.findall(r"`([A-Za-z_][\w.]*)`", text):
        parts = span.split(".")
        if len(parts) > 1 and parts[0][0].islower() and parts[-1] != "py" and parts[0] not in FLAGS - MODULES:
            out.append(span)
    return out


def test_every_cited_function_class_and_attribute_exists():
    text = open(DOC).read()
    missing = []
    for span in sorted(set(cited_code(text))):
        parts = span.split(".")
        n = 2 if parts[0] == "tools" else 1
        if ".".join(parts[:n]) not in MODULES:
            missing.append(span)
            continue
        obj = importlib.import_module("minirl." + ".".join(parts[:n]))
        for attr in parts[n:]:
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif isinstance(obj, type) and attr in getattr(obj, "__dataclass_fields__", {}):
                obj = None  # a dataclass field: present on instances
            else:
                missing.append(span)
                break
    assert not missing, missing
    assert len(set(cited_code(text))) > 60  # the table is read, not skipped


def _tests_in(path: str) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(open(path).read()))
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_every_cited_test_exists():
    """In the rules' table and in every other doc a user reads (the README, docs/*.md): `file.py::test_name`,
    or `file.py (a note)::test_name`."""
    missing, counts = [], {}
    for doc in DOCS:
        cited = re.findall(r"(test_\w+\.py)(?: \([^)]*\))?::(test_\w+)(\*?)", open(doc).read())
        counts[os.path.basename(doc)] = len(cited)
        for file, name, star in cited:
            path = os.path.join(ROOT, "tests", file)
            names = _tests_in(path) if os.path.isfile(path) else set()
            if not (name in names or star and any(n.startswith(name) for n in names)):
                missing.append(f"{os.path.basename(doc)}: {file}::{name}")
    assert not missing, missing
    assert counts["invariants.md"] > 80 and counts["reliability.md"] > 80, counts


def test_every_flag_and_file_the_docs_name_exists():
    """A dotted flag in the docs' prose (`--group.name`, or tyro's `--group.no-name` for a switch) is one of the
    commands', and a path under the repository's folders names a file there, so a rename cannot live on in them
    (the launches the docs show are run by test_recipes.py)."""
    from minirl.config_grpo import GRPOArgs
    from minirl.config_ppo import PPOArgs
    from minirl.flags import _flags
    known = {f"--{name}" for cls in (GRPOArgs, PPOArgs) for name in _flags(cls)}
    missing, flags, paths = [], set(), set()
    for doc in DOCS:
        text = open(doc).read()
        for flag in set(re.findall(r"--[a-z][a-z0-9-]*\.[a-z0-9.-]*[a-z0-9]", text)):
            group, _, name = flag.rpartition(".")
            flags.add(flag)
            if flag not in known and f"{group}.{name.removeprefix('no-')}" not in known:
                missing.append(f"{os.path.basename(doc)}: {flag}")
        for path in set(re.findall(r"(?:minirl|recipes|bench|tests|docs)/[\w/-]+\.(?:py|sh|md|yaml|json|png|cpp)", text)):
            paths.add(path)
            if not os.path.exists(os.path.join(ROOT, path)):
                missing.append(f"{os.path.basename(doc)}: {path}")
    assert not missing, missing
    assert len(flags) > 80 and len(paths) > 50, (len(flags), len(paths))
