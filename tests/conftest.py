import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
# The presets name their data as ${NEUTRENO_DATA}/…; the tests read it from ../shared/data (the
# tests that need it skip when it is absent).
os.environ.setdefault("NEUTRENO_DATA", str(SHARED_DATA))

# A small classification run on the real digits: vit_digits, no augmentation unless a test switches it on.
DIGITS_RUN = {
    "model": {"name": "vit_digits", "args": {"depth": 4}},
    "data": {
        "train": "digits",
        "val": "digits",
        "val_split": "test",
        "image_size": 8,
        "channels": 1,
        "mean": [0.3],
        "std": [0.4],
        "num_workers": 0,
    },
    "augment": {
        "crop_scale": None,
        "hflip": 0.0,
        "randaugment_n": 0,
        "random_erasing": 0.0,
        "mixup_alpha": 0.0,
        "cutmix_alpha": 0.0,
        "label_smoothing": 0.0,
    },
    "optim": {"lr": 2e-3, "lr_base_batch": None, "warmup_epochs": 0.5},
    "train": {"epochs": 2, "batch_size": 32},
}


def digits_config(**sections: dict) -> dict:
    """:data:`DIGITS_RUN` with ``sections`` merged over it key by key (a deep-enough copy)."""
    return {key: {**DIGITS_RUN.get(key, {}), **sections.get(key, {})} for key in {*DIGITS_RUN, *sections}}


@pytest.fixture
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA} (CI puts ../shared beside the repo)")
    return SHARED_DATA


# The longest test files first (by their time in a `--durations=0` run): `make test` hands out whole
# files (--dist loadfile, --no-loadscope-reorder), so a long file handed out last would run alone at the
# end while the other process idles.
LONGEST_FIRST = ("test_reproduce.py", "test_faults.py", "test_training.py", "test_efficiency.py",
                 "test_reproduce_stats.py", "test_analyze.py", "test_hf_sweep.py", "test_segmenter.py",
                 "test_collect.py")  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: in-file order kept
