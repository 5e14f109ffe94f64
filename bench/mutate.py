"""Mutation testing of the minirl modules whose unit tests run in seconds: plant one small bug at a time and see
whether the module's unit tests catch it.

    .venv/bin/python bench/mutate.py                      # every module below, 2 workers
    .venv/bin/python bench/mutate.py gae sampler --jobs 1 # some of them

Each mutant changes one site of the module's syntax tree: a comparison (< to <=, == to !=, in to not
in, ...), an arithmetic operator (+ to -, * to /, ...), `and` to `or`, a `not` dropped, a unary minus
dropped, a number moved by one (0 to 1, 1 to 2, 0.5 to 1.5), True to False. It is written over the
module in a copy of the repository (the working tree is never touched) and the module's tests run
there, fast ones only (`-m "not slow and not vllm and not dist"`; `rollout`'s own engine tests too),
stopping at the first failure. A mutant is killed when a test fails or runs past the time limit; it
survives when they all pass. The survivors are printed as `module.py:line: original -> mutant`, and
listed with a reason each in docs/invariants.md ("Mutation testing").

    .venv/bin/python bench/mutate.py dist --several-ranks  # the survivors again, against the torchrun tests

A survivor that only several ranks can tell apart (a collective's op, a rank's share) is listed as such only
after `--several-ranks` has run it against the fast torchrun tests (`MULTI_RANK`, about 40 s a mutant). Those
tests reach the world, the PPO step and the refit; placement's ranks meet only in the slow end-to-end launches,
so for `placement` the flag mostly costs time (a run stopped after 25 minutes on 2026-12-07 had 34 survivors
past it, each of a kind docs/invariants.md lists).
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import copy
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = {  # module -> the unit tests that guard it
    "gae": ["tests/test_gae.py"],
    "objective": ["tests/test_objective.py"],
    "accumulator": ["tests/test_accumulator.py"],
    "sampler": ["tests/test_sampler.py"],
    "rewards": ["tests/test_rewards.py"],
    "batch": ["tests/test_batch.py", "tests/test_packing.py"],
    "config": ["tests/test_config.py", "tests/test_tasks.py",  # the data flags' checks; the helpers' callers:
               "tests/test_models.py::test_a_model_path_is_a_folder_a_fetched_hub_name_or_refused_naming_both",
               "tests/test_launch.py::test_an_unreadable_config_file_is_named_with_the_parsers_first_line_cut_at_160_"
               "characters"],
    "config_grpo": ["tests/test_config.py", "tests/test_grpo_update.py"],
    "config_ppo": ["tests/test_config.py"],
    "tasks": ["tests/test_tasks.py", "tests/test_rewards.py",  # the load's two hints, said by the first rank,
              "tests/test_user_data.py::test_rows_of_a_verl_data_source_the_built_in_reward_does_not_score_name_verls_"
              "function",
              "tests/test_user_data.py::test_text_prompts_for_a_model_with_a_chat_template_are_said_to_reach_it_as_"
              "they_are",  # and the answers and messages kept as TRL's and verl's functions read them
              "tests/test_user_data.py::test_a_list_or_object_answer_reaches_verls_and_trls_functions_as_it_is",
              "tests/test_user_data.py::test_a_message_of_openais_text_parts_renders_as_vllms_chat_api_renders_it",
              "tests/test_user_data.py::test_trls_quickstart_rows_without_an_answer_load_for_a_trl_function_alone"],
    "stream": ["tests/test_stream.py"],
    "logger": ["tests/test_logger.py"],
    "flags": ["tests/test_config.py", "tests/test_launch.py"],
    "models": ["tests/test_models.py", "tests/test_packing.py", "tests/test_tasks.py"],  # build_tiny's: test_tasks
    "checkpoint": ["tests/test_checkpoint.py"],
    "offload": ["tests/test_offload.py"],
    "dist": ["tests/test_dist.py",  # and the reshard after a no-grad forward, which test_models checks
             "tests/test_models.py::test_no_root_parameter_stays_gathered_after_a_forward_without_autograd"],
    "run": ["tests/test_run.py", "tests/test_ppo.py", "tests/test_checkpoint.py",  # and the export's model card
            "tests/test_launch.py::test_a_model_card_names_a_hub_base_model_in_its_metadata_and_a_folder_by_its_name"],
    "launch": ["tests/test_launch.py", "tests/test_rundir.py", "tests/test_models.py"],  # the model folder's checks
    "grpo": ["tests/test_grpo_update.py", "tests/test_offload.py"],  # the update; the loop around a scripted engine
    "ppo": ["tests/test_ppo.py"],
    "placement": ["tests/test_ppo.py"],
    "refit": ["tests/test_dist.py", "tests/test_ppo.py"],
    "rollout": ["tests/test_rollout.py",  # with the engine: the tiny model's starts in seconds
                "tests/test_plan.py::test_a_config_of_other_names_is_read_as_transformers_reads_it_and_a_vision_"
                "language_one_is_refused",  # with_sizes, which the plan reads through too
                "tests/test_models.py::test_the_weights_a_trainer_sends_and_exports_are_its_checkpoint_files_own",
                "tests/test_models.py::test_every_familys_weights_are_sent_as_save_pretrained_writes_them",
                "tests/test_launch.py::test_a_model_the_cpu_engine_cannot_train_is_refused_before_anything_is_built_"
                "naming_its_flag",  # as_checkpoint and check_reloads; check_trainable:
                "tests/test_launch.py::test_a_quantized_model_is_refused_for_training_by_both_commands_and_their_dry_"
                "runs_on_any_device"],
    "tools/plot": ["tests/test_plot.py"],
    "tools/export": [f"tests/test_launch.py::test_{name}" for name in (  # its fast tests (the rest run a loop first)
        "export_overwrites_only_a_folder_an_export_wrote", "an_export_inside_the_checkpoint_folder_is_refused",
        "export_reads_the_model_from_the_checkpoints_run_or_asks_for_the_flag",
        "what_a_checkpoint_argument_is_instead_is_said_from_its_files",
        "export_never_writes_over_the_root_the_working_directory_or_the_run")],
    "tools/plan": ["tests/test_plan.py", "tests/test_recipes.py::test_every_documented_launch_plans_at_its_world_size"],
    "tools/eval": [f"tests/test_launch.py::test_{name}" for name in (  # its fast tests (the rest score with an engine)
        "eval_of_a_checkpoint_reads_its_runs_config_first_and_the_flags_beside_it_win",
        "eval_without_held_out_prompts_is_refused_before_the_engine",
        "eval_of_a_checkpoint_checks_its_model_and_task_before_the_export",
        "a_sigterm_during_eval_exits_143_and_leaves_no_temporary_folder",
        "a_config_key_is_refused_or_skipped_by_what_it_is_and_which_command_reads_it")]
    + ["tests/test_config.py::test_every_default_is_the_recorded_one"],
}
MULTI_RANK = ["tests/test_dist.py", "tests/test_stream.py"]  # their `RANKS` tests: 2 and 3 ranks
RANKS = "dist and not slow"
WITH_ENGINE = {"rollout"}  # modules whose own tests run the real engine (marked `vllm`): those run too
SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
         ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
         ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
         ast.Mod: ast.FloorDiv, ast.Pow: ast.Mult, ast.And: ast.Or, ast.Or: ast.And}


def sites(tree: ast.AST) -> list[tuple[int, str]]:
    """(node index in ast.walk order, what the mutation does) for every site of `tree`."""
    out = []
    docstrings = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef,
                  ast.ClassDef, ast.AsyncFunctionDef)) and n.body and isinstance(n.body[0], ast.Expr)}
    for i, n in enumerate(ast.walk(tree)):
        if isinstance(n, ast.Compare):
            out += [(i, f"op{j}") for j, op in enumerate(n.ops) if type(op) in SWAPS]
        elif isinstance(n, (ast.BinOp, ast.BoolOp)) and type(n.op) in SWAPS:
            out.append((i, "op"))
        elif isinstance(n, ast.UnaryOp) and isinstance(n.op, (ast.Not, ast.USub)):
            out.append((i, "drop"))
        elif isinstance(n, ast.Constant) and id(n) not in docstrings and (
                isinstance(n.value, bool) or isinstance(n.value, (int, float)) and not isinstance(n.value, bool)):
            out.append((i, "const"))
    return out


def mutate(tree: ast.AST, index: int, how: str) -> tuple[ast.AST, int, str]:
    """A copy of `tree` with site (index, how) mutated; returns it, the site's line and a description."""
    tree = copy.deepcopy(tree)
    node = list(ast.walk(tree))[index]
    line, before = node.lineno, ast.unparse(node)
    if how.startswith("op") and isinstance(node, ast.Compare):
        j = int(how[2:])
        node.ops[j] = SWAPS[type(node.ops[j])]()
    elif how == "op":
        node.op = SWAPS[type(node.op)]()
    elif how == "drop":
        replacement = node.operand
        for parent in ast.walk(tree):
            for field, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, field, replacement)
                elif isinstance(value, list):
                    value[:] = [replacement if v is node else v for v in value]
        return tree, line, f"{before} -> {ast.unparse(replacement)}"
    else:
        v = node.value
        node.value = (not v) if isinstance(v, bool) else v + 1
    return tree, line, f"{before} -> {ast.unparse(node)}"


def run_tests(workdir: str, tests: list[str], timeout: float, marks: str) -> tuple[bool, float]:
    """(passed, seconds) for `tests` of pytest's `marks` in `workdir`."""
    # the copy's minirl in every process the tests start: a script (tests/dist/*.py) or a console script
    # would otherwise import the editable install's, the unmutated working tree
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": workdir}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m",
                            marks, *tests], cwd=workdir, capture_output=True, timeout=timeout, env=env)
        return p.returncode == 0, time.perf_counter() - t0
    except subprocess.TimeoutExpired:
        return False, time.perf_counter() - t0


def copy_repo() -> str:
    d = tempfile.mkdtemp(prefix="minirl-mutate-")
    for name in ("minirl", "tests", "docs", "recipes", "README.md", "pyproject.toml", "Makefile"):  # tests read them
        src = os.path.join(ROOT, name)
        (shutil.copytree if os.path.isdir(src) else shutil.copyfile)(src, os.path.join(d, name))
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("modules", nargs="*", default=list(TESTS), help=f"of {', '.join(TESTS)}")
    ap.add_argument("--jobs", type=int, default=2, help="mutants tested at once (one repository copy each)")
    ap.add_argument("--several-ranks", action="store_true", help="run the survivors against the torchrun tests too")
    a = ap.parse_args()
    workers = [copy_repo() for _ in range(a.jobs)]
    free = list(workers)
    survivors, total = [], 0
    try:
        if a.several_ranks:
            ok, base_ranks = run_tests(workers[0], MULTI_RANK, 600, RANKS)
            if not ok:
                sys.exit("the torchrun tests fail unmutated; fix them first")
        for module in a.modules:
            path = f"minirl/{module}.py"
            source = open(os.path.join(ROOT, path)).read()
            tree = ast.parse(source)
            marks = "not slow and not dist" if module in WITH_ENGINE else "not slow and not vllm and not dist"
            ok, base = run_tests(workers[0], TESTS[module], 600, marks)
            if not ok:
                sys.exit(f"{path}: its tests fail unmutated; fix them first")
            mutants = [mutate(tree, i, how) for i, how in sites(tree)]
            print(f"{path}: {len(mutants)} mutants; its tests take {base:.1f} s", flush=True)

            def one(m):
                workdir = free.pop()
                try:
                    with open(os.path.join(workdir, path), "w") as f:
                        f.write(ast.unparse(m[0]))
                    passed = run_tests(workdir, TESTS[module], 3 * base + 10, marks)[0]
                    if passed and a.several_ranks:  # a mutant only several ranks tell apart is killed here
                        passed = run_tests(workdir, MULTI_RANK, 3 * base_ranks + 10, RANKS)[0]
                    return m, passed
                finally:
                    with open(os.path.join(workdir, path), "w") as f:
                        f.write(source)
                    free.append(workdir)

            with concurrent.futures.ThreadPoolExecutor(a.jobs) as pool:
                for (tree_m, line, what), passed in pool.map(one, mutants):
                    if passed:
                        survivors.append(f"{module}.py:{line}: {what}")
                        print(f"  survived: {survivors[-1]}", flush=True)
            total += len(mutants)
    finally:
        for w in workers:
            shutil.rmtree(w, ignore_errors=True)
    print(f"{total - len(survivors)} of {total} mutants killed; {len(survivors)} survived")


if __name__ == "__main__":
    main()
