"""Zero-shot tasks read from a data folder, framed as lm-evaluation-harness frames them: choice i
of an `Example` is scored by the log-likelihood of `continuations[i]` given `contexts[i]`. Partial
scoring (Winogrande, WSC273) puts the option in the context and scores the shared suffix; LAMBADA
is one "choice": its continuation."""

import csv
import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path


class DataError(RuntimeError):
    """A data file that differs from its pin, is malformed, or is missing and cannot be fetched."""


@dataclass
class Example:
    contexts: list  # [str] one per choice
    continuations: list  # [str] one per choice, each starting with its separating space
    label: int
    group: str = ""  # MMLU subject: accuracies are also macro-averaged over groups


# the files each task reads, relative to the data folder; MMLU reads its pinned subjects' files
TASK_FILES = {
    "piqa": ("piqa/valid.jsonl", "piqa/valid-labels.lst"),
    "arc_easy": ("arc/ARC-Easy-Test.jsonl",),
    "arc_challenge": ("arc/ARC-Challenge-Test.jsonl",),
    "winogrande": ("winogrande/winogrande_1.1/dev.jsonl",),
    "wsc273": ("wsc273/WSCollection.xml",),
    "mmlu": (),
    "logiqa": ("logiqa/Test.txt",),
    "lambada": ("lambada/lambada_openai.jsonl",),
}
MMLU_FOLDER = "mmlu/test"
# pinned with its set, not read: dev.jsonl holds the answers too
PINNED_UNREAD = {"winogrande": ("winogrande/winogrande_1.1/dev-labels.lst",)}


def _example(contexts: list, continuations: list, label: int, group: str, least: int) -> Example:
    """The Example, checked against what scoring needs: `least` choices or more, each continuation
    with text after its space, the label one choice's index; a ValueError says what is not."""
    if len(continuations) < least:
        raise ValueError(f"{len(continuations)} choice(s), fewer than {least}")
    empty = [i for i, continuation in enumerate(continuations) if not continuation.strip()]
    if empty:
        raise ValueError(f"choice {empty[0]}'s continuation is empty")
    if not 0 <= label < len(continuations):
        raise ValueError(f"the label {label} names none of {len(continuations)} choices")
    return Example(contexts, continuations, label, group)


def _choices(context: str, options: list, label: int, group: str = "", least=2) -> Example:
    continuations = [" " + o for o in options]
    return _example([context] * len(options), continuations, label, group, least)


def _partial(prefix: str, options: list, suffix: str, label: int) -> Example:
    """Trinh & Le's partial scoring: each option completes the prefix; the suffix is scored. An
    empty option would score the bare prefix: a ValueError."""
    empty = [i for i, option in enumerate(options) if not option.strip()]
    if empty:
        raise ValueError(f"option {empty[0]} is empty")
    contexts = [prefix + o for o in options]
    return _example(contexts, [" " + suffix.strip()] * len(options), label, "", 2)


def _file(data_dir, relative: str) -> Path:
    path = Path(data_dir) / relative
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}, a task file that dofmini.data.ensure downloads")
    return path


def _label(value, keys: tuple) -> int:
    """The gold answer's index among `keys`: a label that names none is refused, not scored."""
    if value not in keys:
        raise ValueError(f"the label {value!r} is not one of {', '.join(keys)}")
    return keys.index(value)


def _lines(path: Path) -> list:  # numbered from 1
    lines = enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
    return [(number, line) for number, line in lines if line.strip()]


def _parse(path: Path, records, build, expected: str, unit: str = "line") -> list:
    """build(record) of each (number, record) of `records`, read from `path`. A record `build`
    cannot read is one ValueError naming `path`, the record's `unit` and number, and what was
    `expected`: a malformed row, or a label that names no choice, is never an example."""
    examples = []
    for number, record in records:
        try:
            examples.append(build(record))
        except (ValueError, LookupError, TypeError, AttributeError) as err:
            raise ValueError(f"{unit} {number} of {path}: expected {expected} ({err!r})") from None
    if not examples:  # an empty file would score a task on nothing
        raise ValueError(f"{unit} 1 of {path}: expected {expected} (found none)")
    return examples


def _jsonl(relative: str, build, data_dir) -> list:
    """build(object) of each line of a JSON-lines file; its docstring says what a line holds."""
    path = _file(data_dir, relative)
    return _parse(path, _lines(path), lambda line: build(json.loads(line)), build.__doc__)


def _piqa(d: dict) -> Example:
    """a JSON object with "goal", "sol1" and "sol2" (the labels are in valid-labels.lst)"""
    return _choices(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], 0)


def load_piqa(data_dir) -> list:
    questions, answers = TASK_FILES["piqa"]
    examples = _jsonl(questions, _piqa, data_dir)
    path = _file(data_dir, answers)
    labels = _parse(path, _lines(path), lambda y: _label(y.strip(), ("0", "1")), "0 or 1")
    if len(labels) != len(examples):
        raise ValueError(f"{path}: {len(labels)} labels for {len(examples)} questions")
    return [replace(example, label=label) for example, label in zip(examples, labels)]


def _arc(d: dict) -> Example:
    """a JSON object with "answerKey" and "question" ("stem", "choices" of "label", "text")"""
    choices = d["question"]["choices"]
    label = _label(d["answerKey"], tuple(c["label"] for c in choices))
    context = f"Question: {d['question']['stem']}\nAnswer:"
    return _choices(context, [c["text"] for c in choices], label)


def _winogrande(d: dict) -> Example:
    """a JSON object with "answer", "option1", "option2" and "sentence" (one "_" in it)"""
    blanks = d["sentence"].count("_")
    if blanks != 1:  # a second blank would be scored as text
        raise ValueError(f'{blanks} "_" in the sentence')
    before, after = d["sentence"].split("_")  # the blank each option fills
    label = _label(d["answer"], ("1", "2"))
    return _partial(before, [d["option1"], d["option2"]], after, label)


# WSC273's normalisation, as the harness's: an option standing for one of these pronouns becomes
# "X's"; one starting with one of these words mid-sentence starts lowercased
POSSESSIVES = ("my", "his", "her", "our", "their")
LOWERCASED_MID_SENTENCE = ("A", "An", "The", "She", "He", "It", "They", "My", "His", "Her", "Their")


def _wsc(schema) -> Example:
    _clean = lambda s: " ".join((s or "").split())  # noqa: E731
    text = schema.find("text")
    left, pron, right = (_clean(text.findtext(t)) for t in ("txt1", "pron", "txt2"))
    mid_sentence = bool(left) and not left.endswith(".")
    options = []
    for answer in schema.find("answers").findall("answer"):
        option = _clean(answer.text) + ("'s" if pron.lower() in POSSESSIVES else "")
        first, _, rest = option.partition(" ")
        if mid_sentence and first in LOWERCASED_MID_SENTENCE:
            option = " ".join(filter(None, (first.lower(), rest)))
        options.append(option)
    label = _label(_clean(schema.findtext("correctAnswer")).rstrip("."), ("A", "B"))
    return _partial(left + " " if left else "", options, right, label)


def load_wsc273(data_dir) -> list:
    """The first 273 schemas, rebuilt as the Hugging Face `winograd_wsc` set."""
    path = _file(data_dir, *TASK_FILES["wsc273"])
    try:
        schemas = list(ET.parse(path).getroot())[:273]
    except ET.ParseError as err:
        raise ValueError(f"line {err.position[0]} of {path}: expected XML ({err})") from None
    expected = "a <schema> of <text> (txt1, pron, txt2), <answers> and <correctAnswer>"
    return _parse(path, enumerate(schemas, start=1), _wsc, expected, "schema")


def _mmlu(subject: str, row: list) -> Example:
    question, a, b, c, d, answer = row
    context = (
        "The following are multiple choice questions (with answers) about "
        f"{subject.replace('_', ' ')}.\n\n{question.strip()}\n"
        f"A. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:"
    )
    return _choices(context, list("ABCD"), _label(answer.strip(), tuple("ABCD")), subject)


def load_mmlu(data_dir, per_subject=None, only=None) -> list:
    """Letter scoring, as the harness's default MMLU: the options are listed in the context, the
    continuations are " A" .. " D" (so acc_norm equals acc); the first `per_subject` of each
    subject, those named in `only` (every file in the folder when None)."""
    folder = Path(data_dir) / MMLU_FOLDER
    names = sorted(p.name for p in folder.glob("*_test.csv")) if only is None else sorted(only)
    examples = []
    for path in [_file(data_dir, f"{MMLU_FOLDER}/{name}") for name in names]:
        with open(path, newline="", encoding="utf-8") as f:
            reader = csv.reader(f)
            try:
                rows = enumerate(list(reader)[:per_subject], start=1)
            except csv.Error as err:  # a field past csv's size limit
                raise ValueError(f"line {reader.line_num} of {path}: expected CSV, {err}") from None
        build = partial(_mmlu, path.name[: -len("_test.csv")])
        examples += _parse(path, rows, build, "a question, options A..D and its letter", "row")
    return examples


def _logiqa(record: list) -> Example:
    blank, answer, passage, question, *options = record
    if blank or len(options) != 4:
        raise ValueError("not a blank line and 7 lines")
    norm = lambda s: s.replace(".", ". ").strip()  # noqa: E731
    options = [norm(o[2:]) for o in options]
    listed = "".join(f"{letter}. {o}\n" for letter, o in zip("ABCD", options))
    context = f"Passage: {norm(passage)}\nQuestion: {norm(question)}\nChoices:\n{listed}Answer:"
    return _choices(context, options, _label(answer.strip(), tuple("abcd")))


def load_logiqa(data_dir) -> list:
    """Test.txt: records of 8 lines (blank, answer letter, passage, question, four "X." options),
    normalised like the harness: ". " after every period, the option's "X." prefix dropped."""
    path = _file(data_dir, *TASK_FILES["logiqa"])
    lines = path.read_text(encoding="utf-8").split("\n")
    records = [(i + 1, lines[i : i + 8]) for i in range(0, len(lines) - 1, 8)]
    return _parse(path, records, _logiqa, "a blank line, a letter a..d and 6 lines of text")


def _lambada(d: dict) -> Example:
    """a JSON object with "context" and "continuation" (its one "choice")"""
    return _choices(d["context"], [d["continuation"]], 0, least=1)


TASKS = {
    "piqa": load_piqa,
    "arc_easy": partial(_jsonl, *TASK_FILES["arc_easy"], _arc),
    "arc_challenge": partial(_jsonl, *TASK_FILES["arc_challenge"], _arc),
    "winogrande": partial(_jsonl, *TASK_FILES["winogrande"], _winogrande),
    "wsc273": load_wsc273,
    "mmlu": load_mmlu,
    "logiqa": load_logiqa,
    "lambada": partial(_jsonl, *TASK_FILES["lambada"], _lambada),
}


def task_reads(task: str, path: str) -> str:
    """Why a registry row of `task` may not pin `path` (a file its loader never reads, while it
    reads an unpinned one), or "" when it may; "" for a group that is not a task."""
    if task not in TASKS or path in TASK_FILES[task] + PINNED_UNREAD.get(task, ()):
        return ""
    if task == "mmlu" and re.fullmatch(rf"{MMLU_FOLDER}/\w+_test\.csv", path):
        return ""
    named = f"{MMLU_FOLDER}/<subject>_test.csv" if task == "mmlu" else ", ".join(TASK_FILES[task])
    return f"the {task} task reads {named}, not {path!r}"


def bad_limit(limit) -> str:
    """Why `limit` is no count of examples to keep (a negative one would drop the last), or ""."""
    if limit is None or type(limit) is int and limit >= 0:
        return ""
    return f"limit {limit!r}; expected None (every example) or an int 0 or more"


def load_task(name: str, data_dir, limit=None, only=None) -> list:
    """The task's examples from the data folder `data_dir`; `limit` keeps the first N. MMLU keeps
    the first ceil(N/57) of each subject, at most N in all, so a limited run still spreads over the
    subjects it macro-averages; `only`: the names of the files the registry pins for the task, each
    file it reads among them (MMLU reads those), or a DataError."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    why = bad_limit(limit)
    if why:
        raise ValueError(f"load_task: {why}")
    unpinned = [
        path for path in TASK_FILES[name] if only is not None and Path(path).name not in only
    ]
    if unpinned or only is not None and not only:  # MMLU's need: one pinned subject
        what = ", ".join(unpinned) or f"{MMLU_FOLDER}/<subject>_test.csv"
        raise DataError(f"the data registry pins no {what}; the {name} task reads it")
    if limit == 0:  # MMLU's first 0 rows of each subject would read as empty files
        return []
    per_subject = [limit and -(-limit // 57), only] if name == "mmlu" else []
    try:
        return TASKS[name](data_dir, *per_subject)[:limit]
    except ValueError as err:  # a malformed row, named by _parse
        raise DataError(f"a {name} file under {data_dir} is malformed: {err}") from None
