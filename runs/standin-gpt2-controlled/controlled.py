"""The allocation rules tested where the truth is known. "Virtual layers" are one real layer's
queries and keys with their logits scaled by known temperatures s (q and k each times √s, so
q·k/√d becomes s·q·k/√d): difficulty is ordered by construction while the geometry stays real
text's. Layerwise distillation needs only q and k, so no new teacher is needed.

    python runs/standin-gpt2-controlled/controlled.py MODEL --layer 3 --out DIR [--data DIR]

Measured, each stage saved and resumed as reproduce.py's are: every virtual layer's DoF (G/J and
the raw Gram, two λ); its held-out KL against M (Fix students at each of the curve dims, the error
curves); and Fix, proportional, square-root and oracle allocations at one budget, each seed.
"""

import argparse
import dataclasses
import json
import math
from pathlib import Path

import numpy as np
from torch import nn

from dofmini import dof, hub
from dofmini.distill import TrainSettings, distill
from dofmini.files import sha256_file, write_text
from dofmini.study import data, devices, guard, stats, store
from dofmini.study.compare import dof_views, evidence_table, md_table, needs, spaced
from dofmini.study.evaluate import PPL_TEXTS, layer_errors
from dofmini.study.oracle import curves_record
from dofmini.study.run import CALIBRATION

TEMPERATURES = (0.6, 0.8, 1.0, 1.2, 1.4, 1.6)
LAMS = (2.0**-4, 2.0**-8)
RULES = {"dof": "proportional", "dof_sqrt": "power:0.5"}


class VirtualTeacher(nn.Module):
    """A teacher whose layer i is `teacher`'s layer `layer` at temperature temperatures[i]. It gives
    only what distillation and DoF read: every layer's (q, k, v) through `capture`."""

    def __init__(self, teacher, layer: int, temperatures):
        super().__init__()
        if not 0 <= layer < teacher.config.n_layer:
            raise store.RunError(f"--layer {layer}: expected 0..{teacher.config.n_layer - 1}")
        self.teacher, self.layer, self.temperatures = teacher, layer, tuple(temperatures)
        self.config = dataclasses.replace(teacher.config, n_layer=len(self.temperatures))
        self.blocks = nn.ModuleList(_Layer(teacher.blocks[layer].attn) for _ in self.temperatures)
        scales = ",".join(map(str, self.temperatures))
        self.identity = f"{teacher.identity}/layer {layer} at {scales}"

    def capture(self, ids, upto=None):
        """Every virtual layer (upto: the first `upto` of them) from the one real layer."""
        q, k, v = self.teacher.capture(ids, upto=self.layer + 1)[self.layer]  # [B, H, T, d] each
        return [(q * s**0.5, k * s**0.5, v) for s in self.temperatures[:upto]]

    def token_ids(self, token_ids, need: int, what: str):
        return self.teacher.token_ids(token_ids, need, what)


class _Layer(nn.Module):
    """A virtual layer's place for its student's features (replace_attention swaps `attn`)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn


def run(teacher, tokens: dict, args, out: Path, log=store.log) -> dict:
    """Every stage of the experiment on `tokens` {"calib", "train", "heldout"}; results.json."""
    virtual = VirtualTeacher(teacher, args.layer, TEMPERATURES)
    n, budget, ctx = len(TEMPERATURES), args.budget, args.ctx
    base = {"teacher": virtual.identity, "ctx": ctx, "tokens": tokens["hashes"]}
    base["device"] = devices.device_name(teacher)

    def sample():
        x = dof.sample_queries_keys(virtual, tokens["calib"], args.J, 0, ctx)  # [n, H, J, d]
        grid = [(norm, lam) for norm in (True, False) for lam in LAMS]
        found = {f"{'G/J' if g else 'G'}, λ={lam:g}": dof.degrees_of_freedom(x, lam, g).tolist()
                 for g, lam in grid}  # fmt: skip
        return found

    per_head = store.load_or_compute(out / "dof.json", {**base, "J": args.J, "lams": LAMS}, sample)
    settings = lambda seed: TrainSettings(args.steps, args.batch, ctx, data_seed=seed)

    def errors(dims, seed):
        """A student of these dims and seed: its per-layer held-out KL, each stage saved."""
        key = {**base, "dims": list(dims), "seed": seed, **store.training_record(settings(seed))}
        path = out / "students" / f"{'-'.join(map(str, dims))}-s{seed}.json"

        def compute():
            train = tokens["train"]
            student, _ = distill(virtual, dims, train, settings(seed), feature_seed=seed, log=log)
            return layer_errors(virtual, student, tokens["heldout"], ctx, args.windows)

        return store.load_or_compute(path, key, compute)

    ms = list(args.curve_dims)
    curves = curves_record(
        {s: [errors((m,) * n, s) for m in ms] for s in args.seeds}, ms, [budget], 0.0
    )
    layer_dof = per_head[f"G/J, λ={LAMS[0]:g}"]
    dims = {"fix": [budget] * n, "oracle": curves["oracle"][str(budget)]}
    dims |= {v: dof.allocate(layer_dof, budget, rule) for v, rule in RULES.items()}
    kl = {v: {s: errors(d, s)["kl"] for s in args.seeds} for v, d in dims.items()}
    results = {"temperatures": TEMPERATURES, "layer": args.layer, "budget": budget}
    results.update(dof=per_head, curve_dims=ms, curves=curves, dims=dims, kl=kl)
    results["config"] = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    write_text(out / "results.json", json.dumps(results, indent=1, sort_keys=True))
    write_text(out / "report.md", report(results))
    return results


def report(results: dict) -> str:
    """The controlled experiment's report: DoF and the features needed per virtual layer, their
    rank correlation and log-log slope, each layer's β, and the rules against Fix."""
    temps, ms = results["temperatures"], results["curve_dims"]
    found = needs(results["curves"])
    rows = [
        [s, *(f"{max(results['dof'][k][i]):.1f}" for k in results["dof"]), f"{n:.1f}", f"{b:.2f}"]
        for i, (s, n, b) in enumerate(zip(temps, found["layer"], found["beta"]))
    ]
    lines = [f"# Controlled experiment: layer {results['layer']} at temperatures {spaced(temps)}"]
    header = [
        "s",
        *(f"DoF {k}" for k in results["dof"]),
        f"M to KL {found['layer_target']:.3g}",
        "β",
    ]
    lines.append(md_table(header, rows))
    views = [
        v for name, heads in results["dof"].items() for v in dof_views(heads, found, f"{name}: ")
    ]
    lines += ["\nDoF against the M needed (a head's to reach KL "
              f"{found['head_target']:.3g}):\n", evidence_table(ms, views)]  # fmt: skip
    seeds = sorted(results["kl"]["fix"])
    rows = []
    for variant, by_seed in results["kl"].items():
        cells = []
        for view in (np.mean, max):
            own = [float(view(by_seed[s])) for s in seeds]
            fix = [float(view(results["kl"]["fix"][s])) for s in seeds]
            diff = stats.paired_diff(own, fix) if len(seeds) > 1 else (own[0] - fix[0], math.nan)
            relative = 100 * (np.mean(own) / np.mean(fix) - 1)
            cells += [f"{np.mean(own):.4g}", f"{diff[0]:+.4g} ± {diff[1]:.2g} ({relative:+.1f}%)"]
        rows.append([variant, spaced(results["dims"][variant]), *cells])
    header = ["variant", "dims", "mean KL", "− fix, paired (95% CI)", "worst-layer KL", "− fix"]
    lines += [f"\nBudget {results['budget']}, seeds {spaced(seeds)}:\n", md_table(header, rows)]
    return "\n".join(lines) + "\n"


def _fail(message: str):
    raise SystemExit(f"controlled.py: error: {message}")


def main(argv=None):
    p = argparse.ArgumentParser(prog="controlled.py", description=__doc__)
    p.add_argument("model")
    p.add_argument("--layer", type=int, required=True, help="the real layer the virtual ones copy")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, help="the data store (default $DOFMINI_DATA or the cache)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--budget", type=int, default=32)
    p.add_argument("--steps", type=int, default=200)
    for name, default in (("batch", 8), ("ctx", 256), ("J", 1024), ("windows", 32)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args(argv)
    args.curve_dims = (8, 16, 32, 64, 128)
    try:
        args.seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        _fail(f"--seeds {args.seeds!r}: expected comma-separated integers")
    if not args.curve_dims[0] <= args.budget <= args.curve_dims[-1]:
        _fail(f"--budget {args.budget}: the oracle needs one within the curves' M, 8..128")
    with guard.one_line_errors(_fail), guard.locked(args.out, _fail):
        _run(args)


def _run(args):
    folder = data.store_dir(args.data)
    hashes = data.ensure(["wikitext2", "corpus", "heldout"], folder)
    teacher, tokenizer = hub.load(args.model), hub.load_tokenizer(args.model)
    hashes["tokenizer"] = sha256_file(hub.locate(args.model) / "tokenizer.json")
    corpus = [f.path for f in data.files("corpus")]
    texts = {"calib": [CALIBRATION], "heldout": [PPL_TEXTS["heldout"]], "train": corpus}
    tokens = {"hashes": hashes}
    for name, paths in texts.items():
        key = {"files": [hashes[p] for p in paths], "tokenizer": hashes["tokenizer"]}
        cache = args.out / f"tokens-{name}.npy"
        tokens[name] = store.token_ids(cache, key, [folder / p for p in paths], tokenizer, None)
    run(teacher, tokens, args, args.out)


if __name__ == "__main__":
    main()
