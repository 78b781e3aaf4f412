"""The report's figures, verdicts and ordering, on the committed allocation-rule study
(runs/standin-gpt2-rules: every rule at every budget, seeds 0-2, with swap curves) and on its seed 0
alone without curves (the quick profile's shape: one seed, no curves)."""

import copy
import json
import os
import random
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import REPO

from dofmini.study import compare, figures, report, task_train, verdicts
from dofmini.study.stats import Bootstrap, window_bootstrap

RULES_RUN = REPO / "runs" / "standin-gpt2-rules" / "results.json"


@pytest.fixture(scope="module")
def study():
    return json.loads(RULES_RUN.read_text())


@pytest.fixture(scope="module")
def one_seed(study):
    """Seed 0's students alone, no curves: what a one-seed run without oracles writes."""
    found = copy.deepcopy(study)
    found["students"] = {k: s for k, s in found["students"].items() if s["seed"] == 0}
    found["curves"] = None
    found["config"]["seeds"] = [0]
    found["e2e"] = compare.e2e_summary(compare.groups(found["students"]))
    return found


def test_the_figures_are_made_for_three_seeds_with_curves(study, tmp_path):
    pytest.importorskip("matplotlib", reason="the figures are an optional extra")
    text = figures.write(tmp_path, study)
    for name, _, _ in figures.FIGURES:
        assert (tmp_path / name).stat().st_size > 10_000, name
        assert f"]({name})" in text


def test_each_rule_keeps_its_own_look_in_every_figure_whatever_the_run_order():
    """The bank study's 11 rules pass matplotlib's ten colours: none may share a colour and
    marker, and a rule looks the same however its students ran."""
    bank = json.loads((REPO / "runs" / "standin-gpt2-bank" / "results.json").read_text())
    styles = figures._styles(bank)
    assert len(styles) == 11
    assert len({(style["color"], style["marker"]) for style in styles.values()}) == 11
    reversed_run = dict(bank, students=dict(reversed(bank["students"].items())))
    assert figures._styles(reversed_run) == styles


def test_one_seed_without_curves_has_no_curves_figure_and_no_bars(one_seed, tmp_path):
    pytest.importorskip("matplotlib", reason="the figures are an optional extra")
    assert figures.error_curves(one_seed, tmp_path / "curves.png") is False
    figures.e2e_kl(one_seed, tmp_path / "e2e_kl.png")
    assert (tmp_path / "e2e_kl.png").stat().st_size > 10_000
    assert not (tmp_path / "curves.png").exists()


def test_a_j_limited_dof_estimate_is_said_at_the_top_of_the_report(one_seed, tmp_path):
    saturated = copy.deepcopy(one_seed)
    saturated["dof"]["warning"] = "warning: 24 of 24 heads have DoF above J/2 = 512 (...)"
    for results, said in ((one_seed, False), (saturated, True)):
        report.write(tmp_path, results)
        head = (tmp_path / "report.md").read_text().split("## ")[0]
        assert ("**DoF warning: 24 of 24 heads have DoF above J/2" in head) is said


def test_without_matplotlib_the_report_says_how_to_get_the_figures(one_seed, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails, as if absent
    (tmp_path / "e2e_kl.png").write_bytes(b"an earlier run's figure")
    report.write(tmp_path, one_seed)
    assert "`pip install matplotlib`" in (tmp_path / "report.md").read_text()
    assert not list(tmp_path.glob("*.png"))
    assert "figures in" in report.closing(tmp_path, one_seed)


WRITE_REPORT = """import json, sys
from pathlib import Path
from dofmini.study import report
out = Path(sys.argv[1])
results = json.loads(Path(sys.argv[2]).read_text())
report.write(out, results)
print(report.closing(out, results))"""


@pytest.mark.parametrize("broken", ["MPLBACKEND=not-a-backend", "matplotlib raising RuntimeError"])
def test_a_broken_matplotlib_costs_the_figures_not_the_finished_run(tmp_path, broken):
    """A real environment variable, or a real package on the path whose import raises something
    other than ImportError: one warning line, naming the cause and the fix; report.md is written."""
    shadow = tmp_path / "shadow"
    (shadow / "matplotlib").mkdir(parents=True)
    (shadow / "matplotlib" / "__init__.py").write_text('raise RuntimeError("a broken install")')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if broken.startswith("MPLBACKEND"):
        env["MPLBACKEND"] = "not-a-backend"
        cause, fix = "ValueError: Key backend: 'not-a-backend'", "unset MPLBACKEND or set it to a"
    else:
        env.pop("MPLBACKEND", None)
        env["PYTHONPATH"] = os.pathsep.join([str(shadow), str(REPO)])
        cause, fix = "RuntimeError: a broken install", "pip install --force-reinstall matplotlib`"
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "e2e_kl.png").write_bytes(b"an earlier run's figure")
    command = [sys.executable, "-c", WRITE_REPORT, str(tmp_path / "out"), str(RULES_RUN)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    warned = [line for line in done.stdout.splitlines() if line.startswith("warning: ")]
    assert len(warned) == 1 and f"({cause}" in warned[0] and fix in warned[0], warned
    assert "figures in " + str(tmp_path / "out") + ": none (matplotlib cannot" in done.stdout
    text = (tmp_path / "out" / "report.md").read_text()
    assert "## Figures\n\nNo figures: matplotlib cannot be imported (" in text
    assert not list((tmp_path / "out").glob("*.png"))


def test_verdicts_agree_with_the_recorded_intervals(study):
    lines, gains = verdicts.verdict_lines(study), verdicts.headroom(study)
    rules = [name for name in study["e2e"] if not name.startswith("fix/")]
    assert sorted(line.split(":")[0] for line in lines) == sorted(rules)
    for line in lines:
        name, word = line.split(": ")[:2]
        mean, half = study["e2e"][name]["minus_fix"]
        fix = study["e2e"]["fix/softmax/" + name.split("/")[-1]]["e2e_kl"][0]
        gain = gains[name.split("/b")[-1]]["gain"]
        expected = "better" if mean + half < 0 else "worse" if mean - half > 0 else None
        expected = expected or ("cannot resolve" if gain < half / fix else "inconclusive")
        assert word.startswith(expected), line
        assert f"{mean:+.3g} ± {half:.2g}" in line
    assert "dof/softmax/b32: worse" in "\n".join(lines)


def test_one_seed_verdicts_ask_for_seeds(one_seed):
    lines = verdicts.verdict_lines(one_seed)
    assert lines and all("one seed: no interval; run `--seeds 0,1,2`" in line for line in lines)
    assert "not measured" in verdicts.regime(one_seed)


def kept(results, variants) -> dict:
    """results with only the students of `variants`, its e2e rows made again."""
    found = copy.deepcopy(results)
    found["students"] = {k: s for k, s in found["students"].items() if s["variant"] in variants}
    found["e2e"] = compare.e2e_summary(compare.groups(found["students"]))
    return found


def test_without_fix_or_without_rules_the_verdicts_say_which_is_missing(one_seed, tmp_path):
    no_fix = kept(one_seed, ("dof", "dof_sqrt"))
    assert verdicts.verdict_lines(no_fix) == []
    why = verdicts.no_verdict(no_fix)
    expected = "no Fix student beside dof, dof_sqrt at their losses and budgets"
    assert why == f"{expected} (add fix to --variants)"
    assert f"  {why}" in report.closing(tmp_path, no_fix)
    only_fix = kept(one_seed, ("fix", "performer"))
    assert verdicts.no_verdict(only_fix) == "no rule beside Fix in this run"


def with_windows(results, shifts):
    """results with every student's end-to-end KL split into four windows (two articles, 0 and
    1) and shifted by shifts[variant] (0 where not named), its e2e rows made again."""
    found = copy.deepcopy(results)
    for s in found["students"].values():
        shift = shifts.get(s["variant"], 0.0)
        s["e2e_kl_windows"] = [s["e2e_kl"] + shift + d for d in (-1e-4, 1e-4, -2e-4, 2e-4)]
        s["e2e_kl"] = float(np.mean(s["e2e_kl_windows"]))
    found["e2e"] = compare.e2e_summary(compare.groups(found["students"]))
    return found


def test_verdicts_with_windows_draw_seeds_and_articles_and_keep_the_rest_as_diagnostics(study):
    # every rule but dof lies 1e-3 below Fix's windows on every seed and window, dof 1e-3 above,
    # far beyond the windows' ±2e-4: Holm rejects all, and none is at the edge
    results = with_windows(study, {"fix": 1e-3, "dof": 2e-3})
    lines = verdicts.verdict_lines(results, [0, 0, 1, 1])
    assert len(lines) == len(verdicts.verdict_lines(study))
    for line in lines:
        name, word = line.split(": ")[:2]
        suffix = name.partition("/")[2]
        family = sum(other.endswith(f"/{suffix}") for other in results["e2e"]) - 1  # less Fix
        assert word == ("worse" if name.startswith("dof/") else "better"), line
        assert "seeds × articles 95% [" in line and f"(Holm over {family} rules at 0.05)" in line
        assert "; diagnostics: seeds only " in line and ", text only 95% [" in line
    windows = verdicts.verdict_lines(results)  # no articles: each window is its own
    assert all("seeds × windows as articles 95%" in line for line in windows)


def test_a_family_verdict_waits_for_holm_and_says_when_it_is_at_the_edge():
    assert verdicts.family_verdict(Bootstrap(0.5, 0.05, 1.05, 0.001), True) == (
        "worse (at the edge: clears 0 by 5% of its width)"
    )
    assert verdicts.family_verdict(Bootstrap(-0.7, -1.2, -0.2, 0.001), True) == "better"
    assert verdicts.family_verdict(Bootstrap(-0.7, -1.2, -0.2, 0.03), False) == "inconclusive"
    # at b8, p 0.01 <= 0.05/3 is rejected, then 0.03 > 0.05/2 stops the steps; alone at b16,
    # 0.04 <= 0.05 is rejected
    ps = {"a/softmax/b8": 0.01, "b/softmax/b8": 0.04, "c/softmax/b8": 0.03, "a/softmax/b16": 0.04}
    found = {name: Bootstrap(1.0, 0.5, 1.5, p) for name, p in ps.items()}
    assert verdicts.holm_by_family(found) == {
        "a/softmax/b8": (True, 3), "b/softmax/b8": (False, 3), "c/softmax/b8": (False, 3),
        "a/softmax/b16": (True, 1),
    }  # fmt: skip


def test_the_report_reads_the_articles_of_the_end_to_end_windows(one_seed, tmp_path):
    results = with_windows(one_seed, {"dof": 1e-3})
    results["e2e_articles"] = ["a", "a", "b", "b"]
    report.write(tmp_path, results)
    assert "seeds × articles 95%" in (tmp_path / "report.md").read_text()
    assert "seeds × articles 95%" in report.closing(tmp_path, results)


def test_headroom_is_the_oracle_against_fix_on_the_summed_swaps(study):
    gains = verdicts.headroom(study)
    swap = study["curves"]["e2e"]
    fix_16 = sum(curve[1] for curve in swap["mean_kl"])  # M = 16 is measured: no interpolation
    assert gains["16"]["fix"] == pytest.approx(fix_16)
    assert [round(100 * gains[b]["gain"], 1) for b in ("16", "32", "64")] == [1.4, 4.4, 8.1]


def test_the_students_table_is_sorted_by_end_to_end_kl(study):
    table = compare.students(compare.groups(study["students"]), study["teacher"])
    rows = [line.split(" | ") for line in table.splitlines()[3:]]  # after the teacher's row
    means = [float(re.match(r"[0-9.e-]+", row[4]).group()) for row in rows]
    assert means == sorted(means) and len(means) == len(study["e2e"])


def test_the_window_bootstrap_of_the_difference_pairs_windows_and_seeds():
    errors = {"kl": [0.1], "output_rel": [0.2], "kernel_l2": [0.3]}

    def student(seed, windows):
        found = dict(seed=seed, e2e_kl=float(np.mean(windows)), e2e_kl_windows=windows)
        return dict(found, layer_error=errors, wikitext2_ppl=10.0, heldout_ppl=11.0)

    windows = {"fix": [[1.0, 2.0, 4.0], [2.0, 2.0, 3.0]], "dof": [[1.5, 2.0, 5.0], [2.0, 3.0, 3.0]]}
    grouped = {
        (variant, "softmax", 8): {s: student(s, w) for s, w in enumerate(rows)}
        for variant, rows in windows.items()
    }
    found = compare.e2e_summary(grouped)["dof/softmax/b8"]["window_bootstrap"]
    diffs = np.subtract(windows["dof"], windows["fix"])
    assert found["minus_fix"] == window_bootstrap(diffs, **compare.BOOTSTRAP)
    assert found["e2e_kl"] == window_bootstrap(windows["dof"], **compare.BOOTSTRAP)
    assert found["seed"] == compare.BOOTSTRAP["seed"] and found["draws"] == 2000


def test_the_regime_line_sets_untrained_features_against_trained_fix(one_seed):
    results = copy.deepcopy(one_seed)
    fix = results["students"]["fix/softmax/b32/s0"]
    untrained = dict(fix, variant="performer", loss="none", e2e_kl=0.039)
    results["students"]["performer/none/b32/s0"] = untrained
    trained = f"{fix['e2e_kl']:.3g} ({0.039 / fix['e2e_kl']:.0f}×)"
    assert (
        verdicts.regime(results)
        == f"budget 32: untrained 0.039 nats against Fix's trained {trained}"
    )


def correctness(rng, n: int, hits: int) -> list:
    """n made-up 0/1 scores of an evaluation split, `hits` of them 1, in a seeded order."""
    found = [1] * hits + [0] * (n - hits)
    rng.shuffle(found)
    return found


def flipped(correct: list, count: int) -> list:
    """`correct` with its first `count` misses made hits (a negative count: hits made misses)."""
    found, want = list(correct), int(count < 0)
    at = [i for i, x in enumerate(found) if x == want][: abs(count)]
    for i in at:
        found[i] = 1 - want
    return found


def records(correct: list) -> dict:
    return {"correct": correct, "acc": sum(correct) / len(correct),
            "ids": [f"eval:{i}" for i in range(len(correct))]}  # fmt: skip


def test_the_fine_tuned_table_counts_a_task_lifted_only_by_its_paired_interval():
    """Three seeds on 100 examples a task: 10 examples more on every seed lifts a task; 10 more,
    none and 10 fewer on the three seeds does not; one example more on every seed does not (the
    seeds' t-interval, zero wide, called it lifted; drawing the examples again leaves it out)."""
    rng, tasks = random.Random(0), task_train.trainable_tasks()
    zero = {t: records(correctness(rng, 100, 35)) for t in tasks}
    moved = {"arc_easy": (10, 10, 10), "mmlu": (10, 0, -10), "logiqa": (1, 1, 1)}
    seeds = {}
    for seed in range(3):
        flips = {t: moved.get(t, (0, 0, 0))[seed] for t in tasks}
        seeds[str(seed)] = {t: records(flipped(zero[t]["correct"], flips[t])) for t in tasks}
        for record in seeds[str(seed)].values():
            record["examples"] = dict(train=64, select=100, test=100)
    found = {
        "models": {"teacher": seeds, "fix/softmax/b8": seeds, "dof/softmax/b8": seeds},
        "zero_shot": {t: dict(zero[t], n=100) for t in tasks},
        "lr": {t: {"lr": 1e-4, "source": "--finetune-lr"} for t in tasks},
        "selection": {"seed": 55, "size": 100},
    }
    table = report.finetune_table(found)
    assert f"Fine-tuning lifted the teacher on 1 of {len(tasks)} tasks (arc_easy)." in table
    assert "| teacher, not fine-tuned | — | 0.3500 |" in table  # PIQA has no training split
    assert "random.Random(55)" in table and "logiqa 64/100/100, arc_easy 64/100/100" in table
    same = "+0.0000 [+0.0000, +0.0000]"
    assert f"| 1 of {len(tasks)} | {same} | {same} |" in table  # DoF: as the teacher, as Fix
    older = {k: v for k, v in found.items() if k != "selection"}  # before the selection split
    with pytest.raises(ValueError, match="from before the selection split keep no per-example"):
        report.finetune_table(older)


def test_the_paired_interval_is_narrower_than_the_unpaired_where_examples_correlate():
    """A student that scores as Fix does on all but a few examples: paired by example its
    difference has a narrow interval; the same accuracies with Fix's examples in another order
    (the pairing broken) give the same mean and a far wider one. Other examples refuse."""
    rng = random.Random(1)
    fix = correctness(rng, 200, 100)
    student = {str(seed): {"mmlu": records(flipped(fix, 6 + seed))} for seed in range(3)}
    paired_fix = {seed: {"mmlu": records(fix)} for seed in student}
    shuffled = {seed: {"mmlu": records(rng.sample(fix, len(fix)))} for seed in student}
    paired = report.paired(student, paired_fix, ["mmlu"])
    unpaired = report.paired(student, shuffled, ["mmlu"])
    assert paired.mean == pytest.approx(unpaired.mean) == pytest.approx(7 / 200)
    assert paired.low > 0 and 3 * (paired.high - paired.low) < unpaired.high - unpaired.low
    fewer = {seed: {"mmlu": records(fix[:199])} for seed in student}
    with pytest.raises(ValueError, match="paired: seed 0, mmlu: the records scored other"):
        report.paired(student, fewer, ["mmlu"])


def test_the_bank_sentence_compares_only_where_students_share_units():
    cost = json.loads((REPO / "runs" / "standin-gpt2-bank" / "results.json").read_text())["bank"]
    shared = report.bank_words(cost, True)
    assert f"The {cost['students']} layerwise students (the error curves among them)" in shared
    assert f"would take {cost['layer_trainings_alone']} layer trainings." in shared
    alone = dict(cost, students=1, distinct_students=1, units=6, layer_trainings_alone=6)
    said = report.bank_words(alone, False)
    assert said.startswith(" The layerwise student came from 6 layer units (")
    assert "one student at a time" not in said
