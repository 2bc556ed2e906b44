"""The README's Python examples run as written."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_examples_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert len(blocks) >= 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
    assert len(namespace["hidden"]) == len(namespace["model"].blocks) + 1


def test_readme_benchmark_tables_are_rendered_from_the_committed_results():
    """Every table between ``<!-- bench:NAME -->`` markers is what bench/readme_tables.py renders from
    bench/results/NAME.json: a figure typed by hand, or a result rerun without the README, fails."""
    import importlib.util
    import json

    spec = importlib.util.spec_from_file_location(
        "readme_tables", README.parent / "bench" / "readme_tables.py"
    )
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    text = README.read_text()
    assert tables.render(text) == text
    emptied = re.sub(r"(<!-- bench:allocator -->\n).*?(<!-- /bench:allocator -->)", r"\1\2", text, flags=re.S)
    assert emptied != text and tables.render(emptied) == text
    result = json.loads((tables.RESULTS / "allocator.json").read_text())
    first = next(iter(result["cases"].values()))
    assert f"| {first['what']} | {first['default_s']:.3f} s |" in text
