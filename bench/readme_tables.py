"""The README's benchmark tables, rendered from ``bench/results/*.json`` so that every figure there
traces to a run: each table sits between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` and is
rewritten from ``NAME.json`` (with the CPU it ran on) by ``python bench/readme_tables.py``;
``--check`` only says whether the README is up to date (the tests run it).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS, README = ROOT / "bench" / "results", ROOT / "README.md"


def allocator(result: dict) -> list[str]:
    lines = [
        "| step | glibc default | freed memory kept | speed-up |",
        "|---|---|---|---|",
    ]
    for c in result["cases"].values():
        lines.append(f"| {c['what']} | {c['default_s']:.3f} s | {c['keep_s']:.3f} s | {c['speedup']:.2f}× |")
    lines.append("")
    lines.append(
        f"Medians of {result['rounds']} alternating processes of {result['steps']} steps each, on "
        f"{result['machine']['cpu']}, {result['machine']['cpus']} cores, torch {result['machine']['torch']} "
        "(`bench/results/allocator.json`)."
    )
    return lines


TABLES = {"allocator": allocator}


def render(readme: str) -> str:
    """``readme`` with every marked table rewritten from its JSON."""
    for name, table in TABLES.items():
        result = json.loads((RESULTS / f"{name}.json").read_text())
        start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
        pattern = re.compile(re.escape(start) + r"\n.*?" + re.escape(end), re.S)
        if not pattern.search(readme):
            raise SystemExit(f"README.md has no {start} … {end} block")
        block = "\n".join([start, *table(result), end])
        readme = pattern.sub(lambda _, block=block: block, readme)  # no backslash escapes in block
    return readme


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md is not up to date")
    args = parser.parse_args()
    text = README.read_text()
    rendered = render(text)
    if args.check:
        if rendered != text:
            print("README.md's benchmark tables differ from bench/results: run python bench/readme_tables.py")
            return 1
        return 0
    README.write_text(rendered)
    print(f"rewrote the tables of {', '.join(TABLES)} in {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
