"""What a run is made of: its shared state (Run), a student (Student) and a layer unit (Unit), each
made once by the Run with its training settings and its key (the settings and inputs its tensors
depend on; store.py reuses a result only for the same key), and the checks each stage's result's
shape is made of. The pipeline and the modules that do the work import them from here.

The seeds, by role: a student's seed sets both its feature draw (layer l's features drawn with
seed + l) and its training data's order, so Fix and every DoF rule of one seed share both; the
first seed (`Run.dof_seed`) draws DoF's J queries and keys and the teacher's learning-rate grid
runs at it (`Run.grid_seed`); the cost estimate's probes draw with seed 0."""

import bisect
import functools
import itertools
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..distill import TrainSettings
from . import data, evaluate, store

# DoF's allocations (dof.allocate): (rule, how a layer's heads combine, capped at the head size,
# each layer's floor as a share of the budget; None: 1 feature).
ALLOCATIONS = {
    "dof": ("proportional", "max", False, None),
    "dof_clip": ("proportional", "max", True, None),
    "dof_mean": ("proportional", "mean", False, None),
    "dof_sqrt": ("power:0.5", "max", False, None),
    "dof_sqrt_mean": ("power:0.5", "mean", False, None),
    "dof_floor": ("proportional", "max", False, 0.5),
    "dof_inv_sqrt": ("power:-0.5", "max", False, None),
    "dof_inv": ("power:-1", "max", False, None),
}
CALIBRATION = "wikitext-2-raw/wiki.valid.raw"  # DoF calibration text, in the data store
WINDOW_SEED = 0  # the held-out windows' one draw (Run.windows)


@dataclass(frozen=True)
class Student:
    """One student: its dims None while DoF or the curves that give them are pending; `settings`
    and `key` (None with the dims) as Run.student made them."""

    variant: str
    loss: str
    budget: int
    seed: int
    dims: tuple | None
    settings: TrainSettings | None = field(default=None, compare=False)
    key: dict | None = field(default=None, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"{self.variant}/{self.loss}/b{self.budget}/s{self.seed}"

    @property
    def stem(self) -> str:
        return self.name.replace("/", "-")

    def path(self, out: Path) -> Path:  # its tensors, with its key and record as metadata
        return out / "students" / f"{self.stem}.safetensors"


@dataclass(frozen=True)
class Unit:
    """Layer `layer` of a layerwise student trained with `n_features` (bank.py)."""

    loss: str
    layer: int
    n_features: int
    seed: int
    key: dict | None = field(default=None, compare=False, hash=False)

    @property
    def name(self) -> str:
        return f"{self.loss}/l{self.layer}/m{self.n_features}/s{self.seed}"

    def path(self, out: Path) -> Path:  # its z and a, with its key and record as metadata
        return out / "units" / f"{self.name.replace('/', '-')}.safetensors"


@dataclass
class Run:
    """What the stages share: the settings (reproduce.RunConfig), the teacher, the texts and the
    inputs every key holds (teacher, tokenizer, device, data file hashes)."""

    cfg: object
    teacher: object
    tokenizer: object
    ctx: int
    lam: float
    budgets: tuple
    inputs: dict
    texts: dict = field(default_factory=dict)  # name -> token ids

    @property
    def dof_seed(self) -> int:
        return self.cfg.seeds[0]

    @property
    def grid_seed(self) -> int:
        return self.cfg.seeds[0]

    def settings(self, seed: int) -> TrainSettings:
        """A training's settings at `seed` (its data order); a RunError for a context TrainSettings
        refuses."""
        if self.ctx < 2:  # a model of 1 position
            n_pos = self.teacher.config.n_ctx
            said = f"ctx {self.ctx} ({n_pos} positions in the model)"
            raise store.RunError(f"{said}: expected 2 or more")
        cfg = self.cfg
        steps = cfg.steps or max(1, len(self.texts["train"]) // (cfg.batch * self.ctx))
        return TrainSettings(
            steps, cfg.batch, self.ctx, cfg.lr, cfg.lr_a, data_seed=seed, part=cfg.per_device
        )

    def training_inputs(self, seed: int) -> dict:
        """What every training's tensors depend on besides what it trains: the teacher, tokenizer,
        device, corpus and the settings of `seed`."""
        inputs = self.inputs
        corpus = {k: v for k, v in inputs.items() if k.startswith("corpus/")}
        key = dict(
            teacher=inputs["teacher"], tokenizer=inputs["tokenizer"], device=inputs["device"]
        )
        key.update(store.training_record(self.settings(seed)))
        return dict(key, train=corpus, train_chars=self.cfg.train_chars)

    def student(self, variant: str, loss: str, budget: int, seed: int, dims) -> Student:
        """A Student with its settings and key (None while its dims are)."""
        dims = None if dims is None else tuple(dims)
        own = dict(variant=variant, loss=loss, dims=dims, seed=seed)
        key = None if dims is None else {**self.training_inputs(seed), **own}
        return Student(variant, loss, budget, seed, dims, self.settings(seed), key)

    def unit(self, loss: str, layer: int, n_features: int, seed: int) -> Unit:
        own = dict(loss=loss, layer=layer, n_features=n_features, seed=seed)
        return Unit(loss, layer, n_features, seed, {**self.training_inputs(seed), **own})

    def eval_key(self) -> dict:
        """What an evaluation's numbers depend on besides the model. `data` pins every data file
        the run verified and `error_windows` counts the layer errors' windows (supersets of what
        the teacher's evaluation reads, as 0.8 keyed it: its records stay recognised); a result
        measured on held-out windows adds those drawn (of_student's `more`).
        results.json's inputs["read"] gives the order the files are read in."""
        cfg, inputs = self.cfg, self.inputs
        key = dict(ctx=self.ctx, eval_windows=cfg.eval_windows, error_windows=cfg.error_windows)
        key.update(limit=cfg.limit, data={k: v for k, v in inputs.items() if "/" in k})
        return dict(key, tokenizer=inputs["tokenizer"], device=inputs["device"])

    @functools.cached_property
    def windows(self) -> dict:
        """{role: its held-out windows, ascending}: one seeded draw (WINDOW_SEED) without
        replacement over the held-out text's ctx-token windows from --heldout-skip on, cut in
        this order: the layer errors' (error_windows), the error curves' (curve_windows), the
        students' end-to-end KL (e2e_windows) and the swap curves' (e2e_windows). Every role is
        drawn whatever the variants, so runs of other variants score the same windows; spread
        over the whole text, each role spans many of its articles; disjoint, so the end-to-end
        oracle chosen on the swap curves is scored on windows it never saw."""
        cfg = self.cfg
        counts = dict(errors=cfg.error_windows, curves=cfg.curve_windows)
        counts.update(e2e=cfg.e2e_windows, swaps=cfg.e2e_windows)
        pool = range(cfg.heldout_skip, len(self.texts["heldout"]) // self.ctx)
        drawn = random.Random(WINDOW_SEED).sample(pool, sum(counts.values()))
        ends = list(itertools.accumulate(counts.values()))
        cuts = zip([0, *ends], ends)
        return {role: sorted(drawn[a:b]) for role, (a, b) in zip(counts, cuts)}

    def window_ids(self, role: str):
        """The token ids of `role`'s windows, one after another [W·ctx]."""
        ids, ctx = self.texts["heldout"], self.ctx
        return torch.cat([ids[w * ctx : (w + 1) * ctx] for w in self.windows[role]])

    def articles(self) -> dict:
        """{role: the article of each window's first token}: what the verdicts' bootstrap
        resamples. An article starts at each title line ("= Title =", as the store writes
        Wikipedia's); text before the first is article 0, and a file without titles is one."""
        path = evaluate.PPL_TEXTS["heldout"]
        text = (self.cfg.data / path).read_text(encoding="utf-8")
        titles = [found.start() for found in re.finditer(r"^= [^=].* =$", text, re.M)]
        starts = sorted({0, *titles})
        offsets = self.tokenizer.encode(text).offsets  # (first, last) character of each token
        where = lambda w: offsets[w * self.ctx][0]  # noqa: E731
        of = lambda w: bisect.bisect_right(starts, where(w)) - 1  # noqa: E731
        return {role: [of(w) for w in windows] for role, windows in self.windows.items()}

    def of_student(self, spec: Student, **more) -> dict | None:
        """The key of a result measured on `spec`: its own key, the evaluation's, `more`; None
        while its dims are pending."""
        return None if spec.key is None else {"student": spec.key, **self.eval_key(), **more}

    def texts_read(self) -> dict:
        """{text: its data files, in the order read}: DoF's calibration text, the perplexity
        texts and the training corpus, joined in path order, not the registry's row order."""
        corpus = sorted(f.path for f in data.files("corpus"))
        texts = {name: [path] for name, path in evaluate.PPL_TEXTS.items()}
        return dict(calib=[CALIBRATION], **texts, train=corpus)

    def tasks(self) -> tuple:
        return () if self.cfg.limit == 0 else tuple(evaluate.TASKS)

    def files_read(self) -> list:
        """The data files the run reads, in the order read: the texts, then each task's files."""
        texts = itertools.chain(*self.texts_read().values())
        return [*texts, *(f.path for task in self.tasks() for f in data.files(task))]


def check_texts(run: Run) -> None:
    """A RunError naming the text, its files and tokens and what needs more, unless each text holds
    enough tokens: DoF's J queries and keys, a window of ctx for each perplexity, a step's batch of
    windows of training text (the estimate times the teacher's pass on it, whatever trains), and
    the held-out windows of the students' errors, curves and end-to-end KL."""
    cfg, ctx = run.cfg, run.ctx
    held_out = cfg.heldout_skip + cfg.error_windows + cfg.curve_windows + 2 * cfg.e2e_windows
    window = (ctx, f"a window of ctx {ctx}")
    calib = -(-cfg.J // (2 * ctx)) * ctx
    roles = "the layer errors', the curves', the end-to-end KL's and the swaps'"
    skipped = f" after the {cfg.heldout_skip} skipped" if cfg.heldout_skip else ""
    students = (held_out * ctx, f"{roles} {held_out} held-out windows of ctx {ctx}{skipped}")
    step = (cfg.batch * ctx, f"a step's {cfg.batch} windows of ctx {ctx}, as the estimate times it")
    needs = dict(calib=(calib, f"DoF's {cfg.J} queries and keys"), wikitext2=window, train=step)
    needs.update(heldout=students if cfg.variants else window)
    for name, files in run.texts_read().items():
        tokens = len(run.texts[name])
        need, why = needs[name]
        if tokens < need:
            named = ", ".join(str(cfg.data / f) for f in files)
            raise store.RunError(f"{named}: {tokens} tokens; {need} needed ({why})")


# What a stage's result's shape is checked with, beside the code that writes it (compute.py's
# valid_*, endtoend's, finetune_stages'), before a saved one is reused (store.saved): one of the
# same key cut to {}, a string, a short list or a 0 dim would fail the run instead of redoing it.
def is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_list_of(value, count: int, valid) -> bool:
    return isinstance(value, list) and len(value) == count and all(map(valid, value))


def is_share(value) -> bool:
    """A number in [0, 1]: an accuracy."""
    return is_number(value) and 0 <= value <= 1


def has_fields(result, names, valid) -> bool:
    return isinstance(result, dict) and all(valid(result.get(name)) for name in names)


def valid_score(result) -> bool:
    """A task's score (score_examples', a zero-shot record's): the accuracy of n examples."""
    accuracy = has_fields(result, ("acc",), is_share)
    return accuracy and has_fields(result, ("n",), lambda n: type(n) is int and n >= 1)
