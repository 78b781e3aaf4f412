"""Zero-shot tasks read from a data folder, framed as lm-evaluation-harness frames them: choice i
of an `Example` is scored by the log-likelihood of `continuations[i]` given `contexts[i]`. Partial
scoring (Winogrande, WSC273) puts the option in the context and scores the shared suffix; LAMBADA
is one "choice": its continuation."""

import csv
import json
import xml.etree.ElementTree as ET
from dataclasses import dataclass
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


def _choices(context: str, options: list, label: int, group: str = "") -> Example:
    return Example([context] * len(options), [" " + o for o in options], label, group)


def _partial(prefix: str, options: list, suffix: str, label: int) -> Example:
    """Trinh & Le's partial scoring: each option completes the prefix; the suffix is scored."""
    return Example([prefix + o for o in options], [" " + suffix.strip()] * len(options), label)


def _file(data_dir, relative: str) -> Path:
    path = Path(data_dir) / relative
    if not path.is_file():
        raise FileNotFoundError(f"missing {path}, a task file that dofmini.data.ensure downloads")
    return path


def _jsonl(path: Path) -> list:
    lines = path.read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def load_piqa(data_dir) -> list:
    docs = _jsonl(_file(data_dir, "piqa/valid.jsonl"))
    labels = _file(data_dir, "piqa/valid-labels.lst").read_text().split()
    if len(labels) != len(docs):
        raise ValueError(f"piqa: {len(docs)} questions but {len(labels)} labels")
    return [
        _choices(f"Question: {d['goal']}\nAnswer:", [d["sol1"], d["sol2"]], int(y))
        for d, y in zip(docs, labels)
    ]


def load_arc(subset: str, data_dir) -> list:
    examples = []
    for d in _jsonl(_file(data_dir, f"arc/ARC-{subset}-Test.jsonl")):
        choices = d["question"]["choices"]
        label = [c["label"] for c in choices].index(d["answerKey"])
        context = f"Question: {d['question']['stem']}\nAnswer:"
        examples.append(_choices(context, [c["text"] for c in choices], label))
    return examples


def load_winogrande(data_dir) -> list:
    examples = []
    for d in _jsonl(_file(data_dir, "winogrande/winogrande_1.1/dev.jsonl")):
        before, after = d["sentence"].split("_", 1)  # the blank each option fills
        options = [d["option1"], d["option2"]]
        examples.append(_partial(before, options, after, int(d["answer"]) - 1))
    return examples


# WSC273's normalisation, as the harness's: an option standing for one of these pronouns becomes
# "X's"; one starting with one of these words mid-sentence starts lowercased
POSSESSIVES = ("my", "his", "her", "our", "their")
LOWERCASED_MID_SENTENCE = ("A", "An", "The", "She", "He", "It", "They", "My", "His", "Her", "Their")


def load_wsc273(data_dir) -> list:
    """The first 273 schemas, rebuilt as the Hugging Face `winograd_wsc` set."""
    clean = lambda s: " ".join((s or "").split())  # noqa: E731
    examples = []
    for schema in list(ET.parse(_file(data_dir, "wsc273/WSCollection.xml")).getroot())[:273]:
        text = schema.find("text")
        left, pron, right = (clean(text.findtext(t)) for t in ("txt1", "pron", "txt2"))
        mid_sentence = bool(left) and not left.endswith(".")
        options = []
        for answer in schema.find("answers").findall("answer"):
            option = clean(answer.text) + ("'s" if pron.lower() in POSSESSIVES else "")
            first, _, rest = option.partition(" ")
            if mid_sentence and first in LOWERCASED_MID_SENTENCE:
                option = " ".join(filter(None, (first.lower(), rest)))
            options.append(option)
        label = int("B" in clean(schema.findtext("correctAnswer")))
        examples.append(_partial(left + " " if left else "", options, right, label))
    return examples


def load_mmlu(data_dir, per_subject=None, only=None) -> list:
    """Letter scoring, as the harness's default MMLU: the options are listed in the context, the
    continuations are " A" .. " D" (so acc_norm equals acc); the first `per_subject` of each."""
    folder = _file(data_dir, "mmlu/test/abstract_algebra_test.csv").parent
    examples, paths = [], sorted(folder.glob("*_test.csv"))
    for path in [p for p in paths if only is None or p.name in only]:
        subject = path.name[: -len("_test.csv")]
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.reader(f))[:per_subject]
        for question, a, b, c, d, answer in rows:
            context = (
                "The following are multiple choice questions (with answers) about "
                f"{subject.replace('_', ' ')}.\n\n{question.strip()}\n"
                f"A. {a}\nB. {b}\nC. {c}\nD. {d}\nAnswer:"
            )
            examples.append(_choices(context, list("ABCD"), "ABCD".index(answer.strip()), subject))
    return examples


def load_logiqa(data_dir) -> list:
    """Test.txt: records of 8 lines (blank, answer letter, passage, question, four "X." options),
    normalised like the harness: ". " after every period, the option's "X." prefix dropped."""
    lines = _file(data_dir, "logiqa/Test.txt").read_text(encoding="utf-8").split("\n")
    norm = lambda s: s.replace(".", ". ").strip()  # noqa: E731
    examples = []
    for i in range(0, len(lines) - 7, 8):
        answer, passage, question, *options = lines[i + 1 : i + 8]
        options = [norm(o[2:]) for o in options]
        listed = "".join(f"{letter}. {o}\n" for letter, o in zip("ABCD", options))
        context = f"Passage: {norm(passage)}\nQuestion: {norm(question)}\nChoices:\n{listed}Answer:"
        examples.append(_choices(context, options, "abcd".index(answer.strip())))
    return examples


def load_lambada(data_dir) -> list:
    docs = _jsonl(_file(data_dir, "lambada/lambada_openai.jsonl"))
    return [_choices(d["context"], [d["continuation"]], 0) for d in docs]


TASKS = {
    "piqa": load_piqa,
    "arc_easy": partial(load_arc, "Easy"),
    "arc_challenge": partial(load_arc, "Challenge"),
    "winogrande": load_winogrande,
    "wsc273": load_wsc273,
    "mmlu": load_mmlu,
    "logiqa": load_logiqa,
    "lambada": load_lambada,
}


def load_task(name: str, data_dir, limit=None, only=None) -> list:
    """The task's examples from the data folder `data_dir`; `limit` keeps the first N. MMLU keeps
    the first ceil(N/57) of each subject, at most N in all, so a limited run still spreads over the
    subjects it macro-averages; `only`: the MMLU file names to read (the pinned ones)."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; known: {', '.join(TASKS)}")
    per_subject = [limit and -(-limit // 57), only] if name == "mmlu" else []
    try:
        return TASKS[name](data_dir, *per_subject)[:limit]
    except (ValueError, LookupError, TypeError, ET.ParseError) as err:  # a malformed row
        raise DataError(f"a {name} file under {data_dir} is malformed: {err!r}") from None


# Examples per task and tokens one example puts through the model (its choices summed; MMLU's four
# letters share one input), with the GPT-2 tokenizer: the run plan's time estimate uses them.
TASK_SIZES = {
    "piqa": (1838, 74),
    "arc_easy": (2376, 131),
    "arc_challenge": (1172, 145),
    "winogrande": (1267, 44),
    "wsc273": (273, 43),
    "mmlu": (14042, 112),
    "logiqa": (651, 814),
    "lambada": (5153, 85),
}
