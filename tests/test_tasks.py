import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES, data_path

from dofmini.study.data import DataError, files
from dofmini.study.tasks import TASKS, load_task

# Examples in each pinned task file of the store.
TASK_SIZES = {
    "piqa": 1838,
    "arc_easy": 2376,
    "arc_challenge": 1172,
    "winogrande": 1267,
    "wsc273": 273,
    "mmlu": 14042,
    "logiqa": 651,
    "lambada": 5153,
}


@pytest.fixture(scope="module")
def data_dir():
    return data_path()


@pytest.mark.parametrize("name", list(TASKS))
def test_task_has_documented_count_and_valid_labels(data_dir, name):
    examples = load_task(name, data_dir)
    assert len(examples) == TASK_SIZES[name]
    for e in examples:
        assert len(e.contexts) == len(e.continuations) >= 1 and 0 <= e.label < len(e.contexts)
        assert all(c.startswith(" ") and c.strip() for c in e.continuations)
    assert len(load_task(name, data_dir, limit=3)) == 3


def test_mmlu_limit_spreads_over_subjects(data_dir):
    limited = load_task("mmlu", data_dir, limit=120)  # ceil(120 / 57) = 3 per subject, 120 in all
    assert len(limited) == 120 and len({e.group for e in limited}) == 40


def test_mmlu_has_57_subjects_with_letter_continuations(data_dir):
    examples = load_task("mmlu", data_dir)
    assert len({e.group for e in examples}) == 57
    assert all(e.continuations == [" A", " B", " C", " D"] for e in examples)
    assert (
        examples[0]
        .contexts[0]
        .startswith(
            "The following are multiple choice questions (with answers) about abstract algebra.\n\n"
        )
    )
    assert (
        examples[0].contexts[0].endswith("\nA. 0\nB. 4\nC. 2\nD. 6\nAnswer:")
        and examples[0].label == 1
    )


def test_harness_framings(data_dir):
    piqa = load_task("piqa", data_dir, 1)[0]
    assert (
        piqa.contexts
        == ["Question: How do I ready a guinea pig cage for it's new occupants?\nAnswer:"] * 2
    )
    assert piqa.continuations[0].startswith(" Provide the guinea pig") and piqa.label == 0
    arc = load_task("arc_easy", data_dir, 1)[0]
    assert arc.contexts[0] == (
        "Question: Which statement best explains why photosynthesis is the foundation "
        "of most food webs?\nAnswer:"
    )
    assert (
        arc.continuations[0] == " Sunlight is the source of energy for nearly all ecosystems."
        and arc.label == 0
    )
    wino = load_task("winogrande", data_dir, 1)[
        0
    ]  # "Sarah was a much better surgeon than Maria so _ always ..."
    assert wino.contexts == [
        "Sarah was a much better surgeon than Maria so Sarah",
        "Sarah was a much better surgeon than Maria so Maria",
    ]
    assert wino.continuations == [" always got the easier cases."] * 2 and wino.label == 1
    wsc = load_task("wsc273", data_dir, 1)[0]  # the option's article is lowercased mid-sentence
    assert wsc.contexts == [
        "The city councilmen refused the demonstrators a permit because the city councilmen",
        "The city councilmen refused the demonstrators a permit because the demonstrators",
    ]
    assert wsc.continuations == [" feared violence."] * 2 and wsc.label == 0
    logiqa = load_task("logiqa", data_dir, 1)[0]
    assert logiqa.contexts[0].startswith("Passage: In the planning of a new district in a township")
    assert (
        "\nQuestion: Based on the above statement, which of the following can be derived?"
        "\nChoices:\nA. "
        in logiqa.contexts[0]
        and logiqa.contexts[0].endswith("\nAnswer:")
    )
    assert (
        logiqa.continuations[0] == " Civic Park is north of the administrative service area"
        and logiqa.label == 0
    )
    lambada = load_task("lambada", data_dir, 1)[0]
    assert lambada.contexts[0].endswith("I don't care about") and lambada.continuations == [
        " signs"
    ]


def test_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="piqa/valid.jsonl"):
        load_task("piqa", tmp_path)
    with pytest.raises(ValueError, match="unknown task 'hellaswag'"):
        load_task("hellaswag", tmp_path)


def test_mmlu_scores_only_the_subjects_the_registry_pins(tmp_path):
    """A file the registry does not pin is neither scored nor hashed into results.json's inputs,
    so it stays out of the examples."""
    folder = shutil.copytree(FIXTURES / "tasks" / "mmlu", tmp_path / "mmlu")
    held = {p.name for p in (folder / "test").iterdir()}  # 2 of the 57 subjects
    pinned = {Path(f.path).name for f in files("mmlu")} & held  # as evaluate_model passes them
    before = load_task("mmlu", tmp_path, only=pinned)
    shutil.copy(folder / "test" / "astronomy_test.csv", folder / "test" / "zz_extra_test.csv")
    assert load_task("mmlu", tmp_path, only=pinned) == before
    assert {e.group for e in before} == {"abstract_algebra", "astronomy"}


# (task, its file in the fixtures, how one row is damaged, the row named, what is expected): each
# of the seven formats
MALFORMED = [
    ("piqa", "piqa/valid.jsonl", lambda text: text.replace("}", "", 1), "line 1", '"goal"'),
    ("arc_easy", "arc/ARC-Easy-Test.jsonl", lambda text: text.replace('"answerKey"', '"x"', 1),
     "line 1", '"answerKey"'),
    ("winogrande", "winogrande/winogrande_1.1/dev.jsonl", lambda text: text.replace("_", " ", 1),
     "line 1", 'one "_"'),
    ("wsc273", "wsc273/WSCollection.xml", lambda text: text[: len(text) // 2], "line 8", "XML"),
    ("mmlu", "mmlu/test/astronomy_test.csv", lambda text: "a question,A,B\n" + text, "row 1",
     "options A..D"),
    ("logiqa", "logiqa/Test.txt", lambda text: text + "\nb\nA passage.\n", "line 9",
     "a blank line, a letter a..d and 6 lines"),
    ("lambada", "lambada/lambada_openai.jsonl", lambda text: "[1, 2]\n" + text, "line 1",
     '"context"'),
    # a field past csv's size limit: csv.Error, named like any malformed row
    ("mmlu", "mmlu/test/astronomy_test.csv", lambda text: "x" * 200_000 + "\n" + text, "line 1",
     "CSV, field larger than field limit"),
    # an empty file would score the task on nothing
    ("arc_easy", "arc/ARC-Easy-Test.jsonl", lambda text: "", "line 1", "(found none)"),
]  # fmt: skip


def refusal(tmp_path, name, path, change, row) -> str:
    """The one DataError that load_task gives for a copy of the fixture tasks with `path`'s text
    changed, checked to name the task, the file, the row and what was expected."""
    folder = shutil.copytree(FIXTURES / "tasks", tmp_path / "tasks")
    (folder / path).write_text(change((folder / path).read_text()))
    with pytest.raises(DataError, match=rf"a {name} file under {folder} is malformed: \w+") as err:
        load_task(name, folder)
    assert f"{row} of {folder / path}: expected " in str(err.value)
    return str(err.value)


@pytest.mark.parametrize("name, path, damage, row, expected", MALFORMED)
def test_a_malformed_task_file_is_one_error_naming_the_file_and_row(
    tmp_path, name, path, damage, row, expected
):
    message = refusal(tmp_path, name, path, damage, row)
    assert expected in message.split(": expected ", 1)[1]


# (task, its file, the gold label changed to name no choice, the row named, the label)
LABELS = [
    ("piqa", "piqa/valid-labels.lst", lambda text: text.replace("1", "2"), "line 2", "2"),
    ("arc_easy", "arc/ARC-Easy-Test.jsonl", lambda t: t.replace('Key": "B"', 'Key": "E"'), "line 1",
     "E"),
    ("winogrande", "winogrande/winogrande_1.1/dev.jsonl",
     lambda text: text.replace('"answer": "1"', '"answer": "3"'), "line 1", "3"),
    ("wsc273", "wsc273/WSCollection.xml", lambda text: text.replace(">B<", ">C<"), "schema 2", "C"),
    ("mmlu", "mmlu/test/astronomy_test.csv", lambda text: text.replace(",C", ",E"), "row 1", "E"),
    ("logiqa", "logiqa/Test.txt", lambda text: text.replace("\nc\n", "\ne\n", 1), "line 1", "e"),
]  # fmt: skip


@pytest.mark.parametrize("name, path, change, row, label", LABELS)
def test_a_label_that_names_no_choice_is_refused_not_scored(
    tmp_path, name, path, change, row, label
):
    assert f"the label {label!r} is not one of" in refusal(tmp_path, name, path, change, row)


def test_a_task_file_the_registry_does_not_pin_is_not_read(tmp_path):
    shutil.copytree(FIXTURES / "tasks" / "piqa", tmp_path / "piqa")
    with pytest.raises(DataError, match="registry pins no piqa/valid-labels.lst; the piqa task"):
        load_task("piqa", tmp_path, only={"valid.jsonl"})
    with pytest.raises(DataError, match="pins no mmlu/test/<subject>_test.csv; the mmlu task"):
        load_task("mmlu", tmp_path, only=set())
    assert len(load_task("piqa", tmp_path, 2, {"valid.jsonl", "valid-labels.lst"})) == 2
