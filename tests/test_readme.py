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


def test_package_texts_cite_only_what_ships_with_it():
    """Docstrings cited "SPEC §2" (a file outside the repository; docs/math.md holds the same) and preset
    descriptions, shown by `neutreno presets`, named a checkout's ../shared/data where the configs read
    ${NEUTRENO_DATA}; every "math.md §N" cited names a section docs/math.md has."""
    package = README.parent / "src" / "neutreno"
    texts = {path: path.read_text() for path in [*package.rglob("*.py"), *package.rglob("*.yaml")]}
    assert not [str(p) for p, text in texts.items() if re.search(r"\bSPEC(\.md)? §", text)]
    assert not [str(p) for p, text in texts.items() if p.suffix == ".yaml" and "../shared" in text]
    sections = set(re.findall(r"^## (\d+)\.", (README.parent / "docs" / "math.md").read_text(), re.M))
    cited = {n for text in texts.values() for n in re.findall(r"math\.md §(\d+)", text)}
    assert cited and cited <= sections, cited - sections


def test_preset_descriptions_are_whole_sentences():
    """`neutreno presets` showed each file's first comment line: 9 of 23 descriptions stopped mid-sentence
    ("… everything else, seed", "… (the pip package's")."""
    from neutreno.presets import describe_preset, list_presets

    described = list_presets()
    assert len(described) == len(list((README.parent / "src" / "neutreno" / "configs").glob("*.yaml")))
    for name, text in described.items():
        assert text.endswith((".", ")")) and text.count("(") == text.count(")"), (name, text)
    text = "# Seg-T on ADE20K (Strudel et al. 2021): 150 classes.\n# More.\nmodel: {}\n"
    assert describe_preset(text) == "Seg-T on ADE20K (Strudel et al. 2021): 150 classes."
    assert describe_preset("# Paper App. G.9, a run\n# on two lines. Then more.\n") == (
        "Paper App. G.9, a run on two lines."
    )
    assert describe_preset("# A command follows:\n#   neutreno train x\n") == "A command follows"
