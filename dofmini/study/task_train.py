"""The fine-tuning splits of the paper's seven tasks (Tables 3 and 6), framed by tasks.py's own
functions, so a fine-tuned model is trained on exactly the framing it is scored with. The
evaluation splits are the zero-shot scorer's (PIQA validation, ARC test, Winogrande dev, LogiQA
test, MMLU test), except WSC: the paper's 104-example WSC is SuperGLUE's validation split, not the
WSC273 the zero-shot scorer reads. Which training split each task uses, and why, is in SPLITS."""

import csv
from functools import partial

from . import data
from .tasks import (
    MMLU_FOLDER,
    TASK_FILES,
    DataError,
    Example,
    _arc,
    _choices,
    _file,
    _jsonl,
    _label,
    _logiqa,
    _mmlu,
    _parse,
    _winogrande,
    bad_limit,
    load_task,
)

# task: (its training split, its data group, or None where no split is pinned); in Table 3's order
SPLITS = {
    "piqa": ("train.jsonl (16,113): not pinned yet, so PIQA is not fine-tuned", None),
    "logiqa": ("Eval.txt, the dev split (651): Train.txt (7,376) is not pinned", "logiqa_ft"),
    "arc_easy": ("ARC-Easy train (2,251)", "arc_easy_train"),
    "arc_challenge": ("ARC-Challenge train (1,119)", "arc_challenge_train"),
    "winogrande": ("winogrande_1.1 train_l (10,234): train_xl is not pinned", "winogrande_train"),
    "mmlu": ("MMLU validation (1,531, 57 subjects): disjoint from test, 5x dev", "mmlu_train"),
    "wsc": ("SuperGLUE WSC train (554); scored on its validation (104)", "superglue_wsc"),
}  # fmt: skip
TASKS = tuple(SPLITS)


def _superglue_wsc(d: dict) -> Example:
    """a JSON object with "text", "label" (true, false) and "target" ("span1_text",
    "span2_index", "span2_text"): the pronoun starred in the passage, then asked whether it refers
    to the noun, answered " no" or " yes" (lm-evaluation-harness's SuperGLUE WSC prompt)"""
    target, words = d["target"], d["text"].split()
    pronoun, at = target["span2_text"], target["span2_index"]
    if type(at) is not int or not 0 <= at <= len(words) - len(pronoun.split()):
        raise ValueError(f"span2_index {at!r}, not a word of the {len(words)}-word text")
    marked = " ".join([*words[:at], f"*{pronoun}*", *words[at + len(pronoun.split()) :]])
    question = f'does the pronoun "*{pronoun}*" refer to "*{target["span1_text"]}*"?'
    context = f"Passage: {marked}\nQuestion: In the passage above, {question}\nAnswer:"
    return _choices(context, ["no", "yes"], _label(d["label"], (False, True)))


def _mmlu_val(data_dir) -> list:
    """Every question of the pinned mmlu/val/*_val.csv, framed as the MMLU test is."""
    examples = []
    for f in data.files("mmlu_train"):
        path = _file(data_dir, f.path)
        with open(path, newline="", encoding="utf-8") as handle:
            rows = enumerate(list(csv.reader(handle)), start=1)
        build = partial(_mmlu, path.name[: -len("_val.csv")])
        examples += _parse(path, rows, build, "a question, options A..D and its letter", "row")
    return examples


def _logiqa_file(relative: str, data_dir) -> list:
    path = _file(data_dir, relative)
    lines = path.read_text(encoding="utf-8").split("\n")
    records = [(i + 1, lines[i : i + 8]) for i in range(0, len(lines) - 1, 8)]
    return _parse(path, records, _logiqa, "a blank line, a letter a..d and 6 lines of text")


# the files each fine-tuning data group holds that its loader reads; MMLU's: each pinned subject's
GROUP_FILES = {
    "logiqa_ft": ("logiqa/Eval.txt",),
    "arc_easy_train": ("arc/ARC-Easy-Train.jsonl",),
    "arc_challenge_train": ("arc/ARC-Challenge-Train.jsonl",),
    "winogrande_train": ("winogrande/winogrande_1.1/train_l.jsonl",),
    "mmlu_train": (),
    "superglue_wsc": ("superglue_wsc/train.jsonl", "superglue_wsc/val.jsonl"),
}
SUBJECT_FILE = {
    "mmlu_train": "mmlu/val/<subject>_val.csv",
    "mmlu": f"{MMLU_FOLDER}/<subject>_test.csv",
}
TRAIN = {
    "logiqa": partial(_logiqa_file, *GROUP_FILES["logiqa_ft"]),
    "arc_easy": partial(_jsonl, *GROUP_FILES["arc_easy_train"], _arc),
    "arc_challenge": partial(_jsonl, *GROUP_FILES["arc_challenge_train"], _arc),
    "winogrande": partial(_jsonl, *GROUP_FILES["winogrande_train"], _winogrande),
    "mmlu": _mmlu_val,
    "wsc": partial(_jsonl, GROUP_FILES["superglue_wsc"][0], _superglue_wsc),
}
EVAL_WSC = partial(_jsonl, GROUP_FILES["superglue_wsc"][1], _superglue_wsc)


def groups(task: str) -> list:
    """The data groups fine-tuning on `task` reads: its training split's and its evaluation's."""
    train = SPLITS[task][1]
    return [train] if task == "wsc" else [train, task]


def unpinned(task: str) -> list:
    """ "path (group)" of each file fine-tuning on `task` reads that no registry row pins, as the
    zero-shot loaders read only pinned rows (load_task's `only`); MMLU's groups need a subject."""
    missing = []
    for group in groups(task):
        pinned = [f.path for f in data.files(group)]
        reads = GROUP_FILES.get(group, TASK_FILES.get(group))
        missing += [f"{path} ({group})" for path in reads if path not in pinned]
        if not reads and not pinned:
            missing.append(f"{SUBJECT_FILE[group]} ({group})")
    return missing


def trainable_tasks() -> tuple:
    """The tasks with a pinned training split."""
    return tuple(task for task, (_, group) in SPLITS.items() if group)


def load_split(task: str, split: str, data_dir, limit=None) -> list:
    """The first `limit` examples of `task`'s "train" or "eval" split from the data folder."""
    why = bad_limit(limit)
    if why:
        raise ValueError(f"load_split: {why}")
    if split not in ("train", "eval"):  # not another split, nor another task's
        raise ValueError(f"load_split: split {split!r}; expected 'train' or 'eval'")
    if task not in TRAIN:
        why = SPLITS[task][0] if task in SPLITS else f"not one of {', '.join(SPLITS)}"
        raise DataError(f"fine-tuning task {task!r} has no pinned training split ({why})")
    if missing := unpinned(task):  # not a file that merely sits where a pinned one would
        rows = ", ".join(missing)
        raise DataError(f"the data registry has no row for {rows}, which fine-tuning {task} reads")
    if split == "eval" and task != "wsc":
        pinned = {f.path.rsplit("/", 1)[-1] for f in data.files(task)}  # as evaluate.py reads
        return load_task(task, data_dir, limit, pinned)
    try:
        return (TRAIN[task] if split == "train" else EVAL_WSC)(data_dir)[:limit]
    except ValueError as err:  # a malformed row, named by _parse
        raise DataError(f"a {task} {split} file under {data_dir} is malformed: {err}") from None
