"""For maintainers: every data source downloaded afresh (not the store), converted as the store
converts it, and compared with its pin; a table, and a non-zero exit on any mismatch.

    python tests/check_sources.py [--groups piqa,heldout]
"""

import argparse
import tempfile
from pathlib import Path

from dofmini.files import sha256_file
from dofmini.study import data


def check_sources(groups, log=print) -> bool:
    """Log the table for the sources of `groups`; True when every file matches its pin."""
    log("| file | source | bytes | sha256 | matches its pin |\n|---|---|---|---|---|")
    ok = True
    with tempfile.TemporaryDirectory() as scratch:
        for f in data.files(groups):
            tmp = Path(scratch) / f.path
            tmp.parent.mkdir(parents=True, exist_ok=True)
            try:
                data.fetch_verified(f, tmp, bar=False)
                row = f"{f.size} | {f.sha256[:16]}… | yes"
            except data.DataError as err:
                ok = False
                got = (tmp.stat().st_size, sha256_file(tmp)[:16]) if tmp.is_file() else ("—", "—")
                row = f"{got[0]} | {got[1]}… | **no**: {str(err).split('; ')[0]}"
            log(f"| {f.path} | {data.source(f)} | {row} |")
    return ok


def main(argv=None):
    p = argparse.ArgumentParser(prog="python tests/check_sources.py", description=__doc__)
    p.add_argument("--groups", default=",".join(data.GROUPS), help="comma-separated data groups")
    try:
        ok = check_sources(p.parse_args(argv).groups.split(","))
    except data.DataError as err:
        raise SystemExit(f"{p.prog}: error: {err}") from None
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
