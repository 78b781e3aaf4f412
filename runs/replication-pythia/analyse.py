"""The pre-registered analysis (PREREGISTERED.md) of the two runs in the folder given (default:
beside this file): each arm's
end-to-end KL less Fix's, paired by seed and window, with the seeds x articles bootstrap
(stats.cluster_bootstrap) and Holm's correction over the family of four arms at 0.05. Prints
RESULT.md's text."""

import json
import sys
from pathlib import Path

from dofmini.study import compare, stats

HERE = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent
ARMS = {  # arm: (run folder, variant)
    "dof (primary)": ("main", "dof"),
    "dof_mean": ("main", "dof_mean"),
    "dof at λ = 2^-4": ("lam-0.0625", "dof"),
    "oracle_e2e (positive control)": ("main", "oracle_e2e"),
}
LEVEL = 0.05
EDGE = 0.10


def by_seed(results: dict, variant: str) -> dict:
    return compare.groups(results["students"])[(variant, "softmax", 32)]


def main():
    runs = {
        name: json.loads((HERE / name / "results.json").read_text())
        for name in ("main", "lam-0.0625")
    }
    articles = runs["main"]["e2e_articles"]
    assert runs["lam-0.0625"]["held_out"]["e2e"] == runs["main"]["held_out"]["e2e"]  # same windows
    fix = by_seed(runs["main"], "fix")
    fix_mean = sum(s["e2e_kl"] for s in fix.values()) / len(fix)
    found = {}
    for arm, (run, variant) in ARMS.items():
        rows = compare.window_diffs(by_seed(runs[run], variant), fix)
        found[arm] = stats.cluster_bootstrap(rows, articles, **compare.BOOTSTRAP)
    rejected = stats.holm([b.p for b in found.values()], LEVEL)
    count = len(set(articles))
    print(
        f"# Pre-registered replication: result\n\nFix's end-to-end KL {fix_mean:.5g} (seeds "
        f"{sorted(fix)}, {len(articles)} windows in {count} articles). Each arm − Fix, paired by "
        f"seed and window; 95% seeds × articles bootstrap ({compare.BOOTSTRAP['draws']} draws); "
        f"Holm over the {len(ARMS)} arms at {LEVEL}.\n"
    )
    print("| arm | − Fix | % of Fix | 95% interval | p | Holm | verdict |")
    print("|---|---|---|---|---|---|---|")
    for (arm, b), reject in zip(found.items(), rejected):
        side = "better" if b.mean < 0 else "worse"
        edge = " (at the edge)" if reject and stats.at_edge(b.low, b.high, EDGE) else ""
        verdict = f"{side}{edge}" if reject else "inconclusive"
        print(
            f"| {arm} | {b.mean:+.4g} | {100 * b.mean / fix_mean:+.1f}% | [{b.low:+.4g}, "
            f"{b.high:+.4g}] | {b.p:.3g} | {'rejects 0' if reject else 'does not'} | {verdict} |"
        )


if __name__ == "__main__":
    main()
