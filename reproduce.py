"""The paper's comparison for one teacher, in one command: estimate DoF, allocate feature dims, train every
variant, evaluate everything, and write results.json, report.md and SVG charts.

    python reproduce.py gpt2                                  # a named model (downloaded once into weights/)
    python reproduce.py ../shared/weights/standin-gpt2 --profile quick

Each stage saves what it made under --out; running the same command again skips finished stages.
"""

import argparse
import json
import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

import dofmini
from dofmini import dijiang, distill, dof, evaluate, plots
from dofmini.checkpoint import CheckpointError, load_tokenizer

DATA = Path(__file__).resolve().parent.parent / "shared" / "data"
VARIANTS = ("performer", "dijiang", "fix", "dof", "dof_clip")
LOSSES = ("softmax", "l2", "direct")
# ctx None: the model's own context, at most 2048. steps: optimiser steps of `batch` windows of ctx tokens (None:
# one pass over the Wikipedia corpus, as the paper's one pass over its slice).
# eval_windows: perplexity windows per text (None: all of it); limit: examples per task; error_windows: batches of
# 4 held-out windows for the per-layer errors.
PROFILES = {
    "quick": dict(
        ctx=64,
        J=128,
        calib_windows=8,
        steps=4,
        batch=2,
        eval_windows=4,
        limit=4,
        error_windows=1,
        train_chars=200_000,
    ),
    "default": dict(
        ctx=256,
        J=1024,
        calib_windows=64,
        steps=400,
        batch=8,
        eval_windows=128,
        limit=100,
        error_windows=8,
        train_chars=None,
    ),
    "paper": dict(
        ctx=None,
        J=1024,
        calib_windows=64,
        steps=None,
        batch=8,
        eval_windows=None,
        limit=None,
        error_windows=8,
        train_chars=None,
    ),
}
SWEEP_LAMBDA, SWEEP_J = (2.0**-12, 2.0**-8, 2.0**-4, 1.0), (256, 512, 1024, 2048)
PROMPT = "The history of the city begins in the"


def parse_args(argv):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument(
        "model",
        help="a known name (gpt2, pythia-70m, pythia-160m, pythia-410m, pythia-1b) or a\n"
        "checkpoint folder holding config.json, model.safetensors, tokenizer.json",
    )
    p.add_argument(
        "--profile",
        choices=PROFILES,
        default="default",
        help="quick: a smoke run (minutes on CPU); default: meaningful numbers on a stand-in\n"
        "(under an hour on 2 cores); paper: the paper's settings, meant for a GPU",
    )
    p.add_argument("--out", type=Path, help="output folder (default runs/<model>-<profile>)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--loss",
        default="softmax",
        help=f"comma-separated losses for fix/dof/dof_clip: {', '.join(LOSSES)}",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help=f"comma-separated, from {', '.join(VARIANTS)}",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed of every random draw (recorded in the outputs)"
    )
    p.add_argument("--limit", type=int, help="first N examples per task (overrides the profile)")
    p.add_argument(
        "--lam", type=float, help="DoF regulariser λ (default 2^-4 for GPT-2, 2^-8 for Pythia)"
    )
    p.add_argument(
        "--raw-gram", action="store_true", help="DoF from the raw Gram G instead of G/J (SPEC §3)"
    )
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also sweep λ in 2^-12..2^0 and J in 256..2048 and report\n"
        "how the allocation moves (sweep.md)",
    )
    p.add_argument(
        "--data", type=Path, default=DATA, help="the shared data folder (default ../shared/data)"
    )
    args = p.parse_args(argv)
    args.loss, args.variants = args.loss.split(","), args.variants.split(",")
    for value, known, what in ((args.loss, LOSSES, "loss"), (args.variants, VARIANTS, "variant")):
        unknown = [v for v in value if v not in known]
        if unknown:
            raise SystemExit(
                f"reproduce.py: error: unknown {what} {unknown[0]!r}; choose from {', '.join(known)}"
            )
    if args.device not in ("cpu", "cuda") or (
        args.device == "cuda" and not torch.cuda.is_available()
    ):
        raise SystemExit(
            f"reproduce.py: error: --device {args.device} is not available here; use cpu"
            + ("" if args.device != "cuda" else " (torch sees no CUDA device)")
        )
    return args


def stage(path: Path, compute, log):
    """Run `compute` unless `path` holds its saved result; save atomically so an interruption loses nothing."""
    if path.is_file():
        log(f"skip: {path} already done")
        return json.loads(path.read_text())
    result = compute()
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)
    return result


def tokens(out: Path, name: str, files, tokenizer, max_chars=None) -> torch.Tensor:
    """Token ids of text files, encoded once and cached as .npy (no pickle)."""
    cache = out / f"tokens-{name}.npy"
    if not cache.is_file():
        text = "".join(Path(f).read_text(encoding="utf-8") for f in files)[:max_chars]
        np.save(cache, np.array(tokenizer.encode(text).ids, dtype=np.int64))
    return torch.from_numpy(np.load(cache))


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    try:
        teacher = dofmini.load(args.model).to(args.device)
        tokenizer = load_tokenizer(args.model)
    except CheckpointError as err:
        raise SystemExit(f"reproduce.py: error: {err}")
    cfg, prof = teacher.config, dict(PROFILES[args.profile])
    if args.limit is not None:
        prof["limit"] = args.limit
    ctx = min(prof["ctx"] or cfg.n_ctx, cfg.n_ctx, 2048)
    lam = args.lam or (2.0**-4 if cfg.family == "gpt2" else 2.0**-8)
    out = args.out or Path("runs") / f"{Path(str(args.model)).name}-{args.profile}"
    (out / "students").mkdir(parents=True, exist_ok=True)
    (out / "eval").mkdir(exist_ok=True)
    log = lambda msg: print(msg, flush=True)  # noqa: E731
    log(
        f"dofmini: {cfg.name} ({cfg.family}, {cfg.n_layer} layers x {cfg.n_head} heads of {cfg.head_dim}), "
        f"profile {args.profile}, ctx {ctx}, seed {args.seed}, out {out}"
    )

    wiki = args.data / "wikitext-2-raw"
    test_ids = tokens(
        out, "wikitext2-test", [args.data / evaluate.PPL_TEXTS["wikitext2"]], tokenizer
    )
    heldout_ids = tokens(out, "heldout", [args.data / evaluate.PPL_TEXTS["heldout"]], tokenizer)
    train_ids = tokens(
        out,
        "train",
        sorted((args.data / "corpus" / "wikipedia").glob("*.txt")),
        tokenizer,
        prof["train_chars"],
    )
    calib_ids = tokens(out, "wikitext2-valid", [wiki / "wiki.valid.raw"], tokenizer)[
        : prof["calib_windows"] * ctx
    ]
    prof["steps"] = prof["steps"] or max(1, len(train_ids) // (prof["batch"] * ctx))

    def evaluate_model(model):
        return evaluate.evaluate_model(
            model,
            tokenizer,
            {"wikitext2": test_ids, "heldout": heldout_ids},
            ctx,
            prof["eval_windows"],
            prof["limit"],
            data_dir=args.data,
        )

    teacher_result = stage(out / "teacher.json", lambda: evaluate_model(teacher), log)
    log(f"teacher: WikiText-2 perplexity {teacher_result['wikitext2_ppl']:.2f} (ctx {ctx})")

    def estimate():
        t0 = time.time()
        per_head = dof.estimate_dof(
            teacher, calib_ids, lam, prof["J"], args.seed, not args.raw_gram, ctx
        )
        layer = per_head.amax(-1)
        return {
            "lam": lam,
            "J": prof["J"],
            "seed": args.seed,
            "normalize": not args.raw_gram,
            "calibration": f"{wiki / 'wiki.valid.raw'} (first {len(calib_ids)} tokens, ctx {ctx})",
            "per_head": per_head.tolist(),
            "warning": dof.saturation_warning(per_head, prof["J"]),
            "dims": {
                "fix": [cfg.head_dim] * cfg.n_layer,
                "dof": dof.allocate(layer, cfg.head_dim),
                "dof_clip": dof.allocate(layer, cfg.head_dim, cap=cfg.head_dim),
            },
            "seconds": time.time() - t0,
        }

    dof_result = stage(out / "allocation.json", estimate, log)
    write_dof_outputs(out, dof_result, log)
    if args.sweep:
        sweep(out, teacher, calib_ids, ctx, args, log)

    variants = {}
    for variant in args.variants:
        for loss in {"performer": ["none"], "dijiang": ["direct"]}.get(variant, args.loss):
            key = f"{variant}/{loss}"
            dims = dof_result["dims"].get(variant, [cfg.head_dim] * cfg.n_layer)
            student, train_seconds = train_variant(
                teacher, variant, loss, dims, train_ids, ctx, prof, args, out, log
            )

            def evaluate_student():
                errors = distill.layer_errors(
                    teacher, student, heldout_ids, ctx, prof["error_windows"]
                )
                return {
                    "dims": dims,
                    "train_seconds": train_seconds,
                    "layer_error": errors,
                    **evaluate_model(student),
                }

            def evaluate_untrained():  # the draw that training started from, shared by every loss
                return distill.layer_errors(
                    teacher,
                    distill.make_student(teacher, dims, args.seed),
                    heldout_ids,
                    ctx,
                    prof["error_windows"],
                )

            variants[key] = stage(out / "eval" / f"{variant}-{loss}.json", evaluate_student, log)
            if variant in ("fix", "dof", "dof_clip"):
                variants[key]["layer_error_before"] = stage(
                    out / "eval" / f"{variant}-untrained.json", evaluate_untrained, log
                )
            log(f"{key}: WikiText-2 perplexity {variants[key]['wikitext2_ppl']:.2f}")

    results = {
        "teacher": {"name": cfg.name, "identity": teacher.identity, **teacher_result},
        "dof": dof_result,
        "variants": variants,
        # a resumed run skips finished stages, so its own wall time says little: the stages' sum is the cost
        "timings": {
            "stages_seconds": teacher_result["eval_seconds"]
            + dof_result["seconds"]
            + sum(v["train_seconds"] + v["eval_seconds"] for v in variants.values()),
            "this_invocation_seconds": time.time() - t_start,
            "dof_seconds": dof_result["seconds"],
        },
        "config": {
            "profile": args.profile,
            **prof,
            "ctx": ctx,
            "seed": args.seed,
            "device": args.device,
            "losses": args.loss,
            "variants": args.variants,
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "numpy": np.__version__,
        },
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    report = write_report(out, results)
    log("\n" + report["summary"])
    show_generation(teacher, variants, tokenizer, out, log)


def write_dof_outputs(out: Path, result: dict, log):
    """dof.csv (per head), allocation.svg, and the per-layer table on the terminal."""
    per_head, dims = result["per_head"], result["dims"]
    rows = ["layer,head,dof"] + [
        f"{l},{h},{v:.4f}" for l, heads in enumerate(per_head) for h, v in enumerate(heads)
    ]
    (out / "dof.csv").write_text("\n".join(rows) + "\n")
    plots.allocation_chart(
        dims["dof"],
        per_head,
        out / "allocation.svg",
        f"DoF allocation (λ={result['lam']:g}, J={result['J']})",
    )
    log(allocation_table(result))
    if result["warning"]:
        log(result["warning"])


def allocation_table(result: dict) -> str:
    dims = result["dims"]
    lines = [
        "| layer | DoF per head | layer DoF | fix | dof | dof_clip |",
        "|---|---|---|---|---|---|",
    ]
    for l, heads in enumerate(result["per_head"]):
        lines.append(
            f"| {l} | {' '.join(f'{v:.1f}' for v in heads)} | {max(heads):.1f} | {dims['fix'][l]} "
            f"| {dims['dof'][l]} | {dims['dof_clip'][l]} |"
        )
    lines.append(f"| sum | | | {sum(dims['fix'])} | {sum(dims['dof'])} | {sum(dims['dof_clip'])} |")
    return "\n".join(lines)


def sweep(out: Path, teacher, calib_ids, ctx, args, log):
    """How the DoF allocation moves with λ and J, and with the raw Gram instead of G/J (sweep.md)."""

    def run():
        cfg, rows = teacher.config, []
        # rows come back in draw order, so x[..., :J, :] is exactly the size-J draw: one teacher pass serves all J
        x = dof.sample_queries_keys(
            teacher, calib_ids, max(SWEEP_J), args.seed, ctx
        )  # [L, H, J, d]
        for normalize in (True, False):
            for lam in SWEEP_LAMBDA:
                for J in SWEEP_J:
                    layer = dof.degrees_of_freedom(x[:, :, :J], lam, normalize).amax(-1)  # [L]
                    rows.append(
                        {
                            "normalize": normalize,
                            "lam": lam,
                            "J": J,
                            "layer_dof": layer.tolist(),
                            "dims": dof.allocate(layer, cfg.head_dim),
                        }
                    )
        return rows

    rows = stage(out / "sweep.json", run, log)
    lines = ["| Σ̂ | λ | J | layer DoF | dof dims |", "|---|---|---|---|---|"]
    lines += [
        f"| {'G/J' if r['normalize'] else 'G'} | 2^{np.log2(r['lam']):.0f} | {r['J']} | "
        f"{' '.join(f'{v:.0f}' for v in r['layer_dof'])} | {' '.join(map(str, r['dims']))} |"
        for r in rows
    ]
    (out / "sweep.md").write_text("\n".join(lines) + "\n")
    log("\n".join(lines))


def write_report(out: Path, results: dict) -> dict:
    """report.md and the error-by-layer charts; returns the compact terminal summary too."""
    teacher, variants = results["teacher"], results["variants"]
    rows = {"teacher": teacher["tasks"], **{k: v["tasks"] for k, v in variants.items()}}
    ppl = {
        "teacher": teacher["wikitext2_ppl"],
        **{k: v["wikitext2_ppl"] for k, v in variants.items()},
    }
    held = {"teacher": teacher["heldout_ppl"], **{k: v["heldout_ppl"] for k, v in variants.items()}}
    avg = {k: float(np.mean([t["acc"] for t in r.values()])) for k, r in rows.items()}
    summary = [
        "| model | WikiText-2 ppl | held-out ppl | task avg acc | Δ avg vs teacher | train s |",
        "|---|---|---|---|---|---|",
    ]
    for k in rows:
        train = variants[k]["train_seconds"] if k in variants else 0.0
        summary.append(
            f"| {k} | {ppl[k]:.2f} | {held[k]:.2f} | {avg[k]:.4f} | {avg[k] - avg['teacher']:+.4f} "
            f"| {train:.0f} |"
        )
    headline = []
    for loss in LOSSES:
        fix, dof_ = variants.get(f"fix/{loss}"), variants.get(f"dof/{loss}")
        if fix and dof_:
            for name, t, f, d in (
                ("WikiText-2 ppl", ppl["teacher"], fix["wikitext2_ppl"], dof_["wikitext2_ppl"]),
                ("held-out ppl", held["teacher"], fix["heldout_ppl"], dof_["heldout_ppl"]),
            ):
                share = (f - d) / (f - t) if f != t else float("nan")
                headline.append(
                    f"- {loss} loss, {name}: teacher {t:.2f}, Fix {f:.2f}, DoF {d:.2f}: "
                    f"DoF removes {100 * share:.1f}% of Fix's degradation"
                )
    errors, charts = [], []
    for metric in ("kl", "output_rel", "kernel_l2"):
        # DiJiang has no kernel to compare and its gate reads the block input: it has no per-layer errors
        series = {k: e for k, v in variants.items() if None not in (e := v["layer_error"][metric])}
        if not series:
            continue
        n_layer = len(next(iter(series.values())))
        errors += [
            f"\n**{metric}**\n",
            "| variant | " + " | ".join(f"L{l}" for l in range(n_layer)) + " | mean |",
            "|---" * (n_layer + 2) + "|",
        ]
        for k, s in series.items():
            before = variants[k].get("layer_error_before", {}).get(metric)
            for label, e in ((k, s), (f"{k} before training", before)):
                if e is not None:
                    errors.append(
                        f"| {label} | "
                        + " | ".join(f"{x:.4g}" for x in e)
                        + f" | {np.mean(e):.4g} |"
                    )
        plots.line_chart(
            series,
            out / f"error_{metric}.svg",
            f"per-layer {metric} by variant",
            metric,
            log_y=metric != "output_rel",
        )
        charts.append(f"![{metric}](error_{metric}.svg)")
    times = ["| model | train s | perplexity pass s | full evaluation s |", "|---|---|---|---|"]
    times += [
        f"| {k} | {v.get('train_seconds', 0):.1f} | {v['ppl_seconds']:.1f} | {v['eval_seconds']:.1f} |"
        for k, v in {"teacher": teacher, **variants}.items()
    ]
    cfg, timings = results["config"], results["timings"]
    text = "\n".join(
        [
            f"# dofmini report: {teacher['name']} ({cfg['profile']} profile)",
            "",
            f"ctx {cfg['ctx']}, seed {cfg['seed']}, DoF λ={results['dof']['lam']:g}, J={results['dof']['J']}, "
            f"{'G/J' if results['dof']['normalize'] else 'raw G'}; the stages took {timings['stages_seconds']:.0f} s in all "
            f"(this invocation: {timings['this_invocation_seconds']:.0f} s).",
            "",
            "## Feature dimensions per layer",
            "",
            allocation_table(results["dof"]),
            "",
            "![allocation](allocation.svg)",
            "",
            "## Perplexity and zero-shot accuracy",
            "",
            "\n".join(summary),
            "",
            evaluate.results_table(rows),
            "",
            "## Share of the Fix degradation removed by DoF",
            "",
            "\n".join(headline) or "(needs both fix and dof variants)",
            "",
            "## Per-layer approximation error (teacher inputs, held-out text, mean over heads)",
            "",
            "kernel_l2 compares unnormalised kernel values. The softmax and direct losses leave each row's scale free,",
            "so for students trained with them kl and output_rel are the errors that count.",
            "\n".join(errors),
            "",
            " ".join(charts),
            "",
            "## Times",
            "",
            "\n".join(times),
            "",
        ]
    )
    (out / "report.md").write_text(text)
    return {"summary": "\n".join(summary + [""] + headline)}


def train_variant(teacher, variant, loss, dims, train_ids, ctx, prof, args, out, log):
    """Train one student (or draw it, for the untrained Performer) and save it; a saved one is loaded instead.
    An interrupted run resumes from the progress file distill keeps beside the student."""
    path = out / "students" / f"{variant}-{loss}.safetensors"
    meta = {"variant": variant}

    def train():
        t0 = time.time()
        opts = dict(
            steps=prof["steps"],
            batch=prof["batch"],
            ctx=ctx,
            seed=args.seed,
            out_path=path,
            log=log,
            meta=meta,
        )
        if variant == "performer":
            distill.save_student(distill.make_student(teacher, dims, args.seed), path, meta)
        elif variant == "dijiang":
            distill.train_direct(dijiang.make_dijiang(teacher, args.seed), train_ids, **opts)
        elif loss == "direct":
            distill.train_direct(distill.make_student(teacher, dims, args.seed), train_ids, **opts)
        else:
            distill.distill(teacher, dims, train_ids, loss, **opts)
        return {"train_seconds": time.time() - t0}

    log(f"{variant}/{loss}: dims {dims}")
    info = stage(path.with_suffix(".json"), train, log)
    return distill.load_student(teacher, path), info["train_seconds"]


def show_generation(teacher, variants, tokenizer, out, log):
    """A greedy continuation of PROMPT from the teacher (KV cache) and from the best trained student
    (recurrent O(1)-state decoding)."""
    trained = [k for k in variants if not k.startswith("performer")] or list(variants)
    if not trained:
        return
    best = min(trained, key=lambda k: variants[k]["wikitext2_ppl"])
    student = distill.load_student(
        teacher, out / "students" / f"{best.replace('/', '-')}.safetensors"
    )
    prompt = tokenizer.encode(PROMPT).ids
    log(f"\ngreedy continuations of {PROMPT!r}:")
    for name, model in (("teacher", teacher), (best, student)):
        log(f"  {name}: {tokenizer.decode(dofmini.generate(model, prompt, 24)[len(prompt) :])!r}")


if __name__ == "__main__":
    main()
