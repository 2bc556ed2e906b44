"""neutreno.allocator: freed CPU memory is reused, already touched, instead of fresh zero pages."""

import os
import platform
import subprocess
import sys

import pytest

# A 256 MB tensor freed, then a 240 MB one: does the second reuse the first's pages? Minor page faults
# count the pages the kernel had to map fresh (65,536 per 256 MB of 4 KiB pages).
SCRIPT = """
import resource, sys, torch
from neutreno.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
x = torch.ones(64 << 20)
del x
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
y = torch.ones(60 << 20)
print(applied, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run(mode: str, **env: str) -> tuple[str, int]:
    base = {k: v for k, v in os.environ.items() if k != "NEUTRENO_MALLOC"}  # a developer's own setting
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, env={**base, **env},
        check=True,
    )  # fmt: skip
    applied, faults = done.stdout.split()
    return applied, int(faults)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the allocator setting is glibc's mallopt")
def test_freed_memory_is_reused_without_fresh_pages():
    default_applied, default_faults = run("default")
    applied, faults = run("keep")
    assert (default_applied, applied) == ("None", "True")
    assert default_faults > 50_000  # glibc's default: the 240 MB come as fresh zero pages (~61,000)
    assert faults < 1_000  # kept: the freed block is reused, its pages already there
    # NEUTRENO_MALLOC=default leaves glibc's behaviour
    assert run("keep", NEUTRENO_MALLOC="default")[0] == "False"
    assert run("keep", NEUTRENO_MALLOC=" Keep")[0] == "True"


def test_an_unknown_setting_is_refused_in_one_line(monkeypatch, capsys):
    """NEUTRENO_MALLOC=off (or 0, none) was read as no opt-out: the process-wide setting was applied."""
    from neutreno.allocator import keep_freed_memory
    from neutreno.cli import main as cli

    for value in ("off", "0", "defaults"):
        monkeypatch.setenv("NEUTRENO_MALLOC", value)
        with pytest.raises(ValueError, match=f"must be 'default' .* or 'keep', got '{value}'"):
            keep_freed_memory()
    monkeypatch.setattr(sys, "argv", ["neutreno", "presets"])
    assert cli.run() == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "neutreno: error: NEUTRENO_MALLOC must be 'default' (glibc's allocator as it is) or 'keep', "
        "got 'defaults'\n"
    )


def test_the_program_keeps_freed_memory_and_main_does_not(monkeypatch, capsys):
    """The console script and ``python -m neutreno`` (``run``) set it, a process-wide choice; ``main``,
    which tests and scripts call in their own process, does not."""
    import neutreno.allocator
    from neutreno.cli import main as cli

    calls = []
    monkeypatch.setattr(neutreno.allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli.main(["presets"]) == 0 and calls == []
    monkeypatch.setattr(sys, "argv", ["neutreno", "presets"])
    assert cli.run() == 0 and calls == [1]
    assert "cifar10_vit_neutreno" in capsys.readouterr().out
