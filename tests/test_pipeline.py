"""The run written once: for any flag combination, --plan-only lists exactly the stages the run then
executes, in the same order, and the run ends normally. Each combination runs reproduce.main in
this process (conftest's reproduce_here) on the tiny fixture with every task and fine-tuning
split (test_finetune's tuning_store): its plan first, then the run, whose stage lines must count
1..N through the plan's names."""

import re

import pytest
from test_finetune import tuning_store

from dofmini.study import task_train

# budgets 8 is the tiny model's head size; 4 and 16 are not
COMBINATIONS = {
    "the quick profile as it is": [],
    "budgets without the head size, two seeds": ["--budgets", "4,16", "--seeds", "0,1"],
    "dijiang alone, at another budget": ["--variants", "dijiang", "--budgets", "16"],
    "the performer's draw alone": ["--variants", "performer", "--budgets", "4,8"],
    "the oracle alone": ["--variants", "oracle", "--curve-dims", "4,8,16"],
    "the end-to-end oracle alone": ["--variants", "oracle_e2e", "--curve-dims", "4,8"],
    "both oracles, curves over the budget": ["--variants", "fix,oracle,oracle_e2e",
                                             "--curve-dims", "4,8,16", "--seeds", "0,1"],
    "l2 loss": ["--loss", "l2", "--variants", "fix,dof,oracle", "--curve-dims", "4,8"],
    "direct loss": ["--loss", "direct", "--variants", "fix,dof_mean"],
    "two losses, one rule": ["--loss", "softmax,l2", "--variants", "dof"],
    "no tasks": ["--limit", "0", "--variants", "fix,performer"],
    "no students": ["--variants", "none"],
    "three seeds, two rules": ["--seeds", "0,1,2", "--variants", "fix,dof_sqrt", "--budgets", "4"],
}  # fmt: skip
STAGE_LINE = re.compile(r"^\[(\d+)/(\d+)\] (.+) \(run: ", re.M)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    return tuning_store(tmp_path_factory.mktemp("store"))


def planned(out: str) -> list:
    """The stage names of a plan's listing, in order."""
    listing = out.split("plan (each student: ", 1)[1].split(" stages done", 1)[0]
    return re.findall(r"^  (.+?): (?:done|~[\d.]+ (?:s|min|h) \()", listing, re.M)


def executed(out: str) -> list:
    """The stage names of a run's progress lines, checked to count 1..N of the plan's N."""
    lines = STAGE_LINE.findall(out)
    assert [int(i) for i, _, _ in lines] == list(range(1, len(lines) + 1)), lines
    assert {int(n) for _, n, _ in lines} <= {len(lines)}, lines
    return [name for _, _, name in lines]


def check_plan_equals_run(reproduce_here, store, tmp_path, args):
    model, env = store
    argv = [model, "--profile", "quick", "--out", tmp_path / "out", *args]

    def run(*more) -> str:
        done = reproduce_here(*argv, *more, env=env)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    plan = planned(run("--plan-only"))
    out = run()
    assert planned(out) == plan  # the run's own plan is the same
    assert executed(out) == plan
    assert (tmp_path / "out" / "report.md").is_file()
    again = run("--plan-only")
    assert f"{len(plan)} of {len(plan)} stages done" in again  # nothing left after the run
    return plan


@pytest.mark.parametrize("args", COMBINATIONS.values(), ids=COMBINATIONS)
def test_the_plan_lists_exactly_the_stages_the_run_executes(reproduce_here, store, tmp_path, args):
    plan = check_plan_equals_run(reproduce_here, store, tmp_path, args)
    assert plan[:2] == ["teacher evaluation", "DoF estimate"]
    if "dijiang" in args:
        assert plan[2:] == ["dijiang/direct/b8/s0"]  # DiJiang at the head size, not --budgets


def test_fine_tuning_is_planned_as_it_runs(reproduce_here, store, tmp_path):
    """--finetune: the grid on WSC only (the other tasks given rates), one student."""
    given = ",".join(f"{task}=1e-4" for task in task_train.trainable_tasks() if task != "wsc")
    args = ["--variants", "fix", "--finetune", "--finetune-lr", given]
    plan = check_plan_equals_run(reproduce_here, store, tmp_path, args)
    assert plan[3:] == ["fine-tuning teacher: zero-shot", "fine-tuning teacher: grid",
                        "fine-tuning teacher/s0", "fine-tuning fix/softmax/b8/s0"]  # fmt: skip
