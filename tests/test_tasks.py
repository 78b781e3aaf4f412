import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import FIXTURES, data_path

from dofmini.study import task_train
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


# (task, its file, a record changed to break its format, the row named, what is expected): a
# record that parses but names a choice that is not there, or scores nothing, is no example
WRONG_RECORDS = [
    ("wsc273", "wsc273/WSCollection.xml",
     lambda t: t.replace("<answer>Anna</answer><answer>Beth</answer>", "<answer>Anna</answer>"),
     "schema 2", "1 choice(s), fewer than 2"),
    ("arc_easy", "arc/ARC-Easy-Test.jsonl",
     lambda t: t.replace('{"text": "oxygen", "label": "A"}, ', "", 1).replace(
         ', {"text": "helium", "label": "C"}', "", 1), "line 1", "1 choice(s), fewer than 2"),
    ("arc_easy", "arc/ARC-Easy-Test.jsonl", lambda t: t.replace('"oxygen"', '" "', 1), "line 1",
     "choice 0's continuation is empty"),
    ("lambada", "lambada/lambada_openai.jsonl", lambda t: t.replace('"Rex"', '""', 1), "line 1",
     "choice 0's continuation is empty"),
    ("winogrande", "winogrande/winogrande_1.1/dev.jsonl",
     lambda t: t.replace("_ was", "_ was _", 1), "line 1", '2 "_" in the sentence'),
    ("winogrande", "winogrande/winogrande_1.1/dev.jsonl",
     lambda t: t.replace("_ was too big.", "_", 1), "line 1", "choice 0's continuation is empty"),
    ("winogrande", "winogrande/winogrande_1.1/dev.jsonl",
     lambda t: t.replace('"the cup"', '""', 1), "line 1", "option 0 is empty"),
]  # fmt: skip


@pytest.mark.parametrize("name, path, change, row, says", WRONG_RECORDS)
def test_a_record_against_its_format_is_refused_naming_the_file_and_record(
    tmp_path, name, path, change, row, says
):
    assert says in refusal(tmp_path, name, path, change, row)


def superglue_wsc(folder: Path, split: str, index: int) -> Path:
    """`folder` holding a SuperGLUE WSC `split` file of one record, its pronoun at `index`."""
    target = {"span1_text": "Beth", "span2_index": index, "span2_text": "she"}
    record = {"text": "Anna thanked Beth because she had helped.", "label": True, "target": target}
    path = folder / "superglue_wsc" / f"{split}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record) + "\n")
    return path


@pytest.mark.parametrize("index", [-1, 7, 40, True])
def test_a_coreference_index_past_the_passage_is_refused(tmp_path, index):
    path = superglue_wsc(tmp_path, "train", index)
    with pytest.raises(DataError) as err:
        task_train.load_split("wsc", "train", tmp_path)
    assert f"line 1 of {path}: expected " in str(err.value)
    assert f"span2_index {index!r}, not a word of the 7-word text" in str(err.value)
    superglue_wsc(tmp_path, "train", 4)  # "she": the fifth word
    assert len(task_train.load_split("wsc", "train", tmp_path)) == 1


@pytest.mark.parametrize("limit", [-1, -5, True, 1.5, "2"])
def test_a_limit_that_is_no_count_is_refused_not_applied(tmp_path, limit):
    with pytest.raises(ValueError, match=rf"load_task: limit {re.escape(repr(limit))}; expected"):
        load_task("arc_easy", FIXTURES / "tasks", limit)
    superglue_wsc(tmp_path, "train", 4)
    with pytest.raises(ValueError, match=rf"load_split: limit {re.escape(repr(limit))}; expected"):
        task_train.load_split("wsc", "train", tmp_path, limit)


@pytest.mark.parametrize("name", list(TASKS))
def test_a_limit_of_0_keeps_no_examples_of_any_task(name):
    assert load_task(name, FIXTURES / "tasks", 0) == []


@pytest.mark.parametrize("split", ["test", "validation", "Train", ""])
def test_a_split_name_that_is_not_train_or_eval_is_refused(tmp_path, split):
    """Not another task's examples: any name but "train" read the SuperGLUE WSC evaluation."""
    shutil.copytree(FIXTURES / "tasks", tmp_path, dirs_exist_ok=True)
    superglue_wsc(tmp_path, "val", 4)
    with pytest.raises(ValueError, match=rf"load_split: split {split!r}; expected 'train' or"):
        task_train.load_split("arc_easy", split, tmp_path)
