"""The plot helpers every PNG uses: axis names in words, whole-layer ticks, y ranges that keep a tiny
spread flat (checked on the matplotlib objects, not on pixels)."""

from pathlib import Path

import pytest

from neutreno.diagnostics.layerwise import METRICS
from neutreno.reporting import (
    LAYER_AXIS,
    METRIC_NAMES,
    METRIC_RANGES,
    layer_axis,
    metric_name,
    pyplot,
    readable_ylim,
)


@pytest.fixture
def ax():
    plt = pyplot()
    fig, ax = plt.subplots()
    yield ax
    plt.close(fig)


def test_every_layer_metric_has_a_name_in_words():
    for key in METRICS:
        assert key in METRIC_NAMES, key  # named by hand, not just the key with spaces
    assert metric_name("cosine") == "token cosine similarity"
    assert metric_name("top1") == "top-1 accuracy (%)"


def test_a_spread_of_1e_4_near_1_stays_a_flat_line_below_the_cosine_bound(ax):
    values = [0.99991, 0.99999, 0.99995]
    ax.plot([1, 2, 3], values)
    low, high = readable_ylim(ax, bounds=METRIC_RANGES["cosine"])
    # at least a tenth of the values' size (0.1), moved down so it ends (with a 5% margin) at 1
    assert high - low == pytest.approx(0.1, rel=1e-4)
    assert high == pytest.approx(1.005, rel=1e-6) and low == pytest.approx(0.905, rel=1e-5)
    assert low < min(values) and max(values) < high
    assert not ax.yaxis.get_major_formatter().get_useOffset()  # no "1e-5 + 9.999e-1" above the axis


def test_a_wide_spread_keeps_matplotlibs_range(ax):
    ax.plot([0, 1, 2], [0.2, 0.9, 0.5])
    before = ax.get_ylim()
    assert readable_ylim(ax, bounds=(-1.0, 1.0)) == pytest.approx(before)


def test_the_widened_range_stays_inside_a_lower_bound(ax):
    ax.plot([0, 1], [0.0002, 0.0003])
    low, high = readable_ylim(ax, min_span=0.1, bounds=(0.0, 1.0))
    assert low == pytest.approx(-0.005) and high - low == pytest.approx(0.1)


def test_values_past_a_bound_stay_on_the_axis(ax):
    """An AttnScale head's nonlocal energy below 0 (bounds (0, None)) was moved off the axis."""
    ax.plot([0, 1], [-0.100, -0.099])
    low, high = readable_ylim(ax, bounds=(0.0, None))
    assert low < -0.100 and high > -0.099


def test_all_zero_values_get_a_range(ax):
    ax.plot([0, 1], [0.0, 0.0])
    low, high = readable_ylim(ax)
    assert low < 0 < high


def test_a_log_axis_shows_at_least_a_decade_in_plain_numbers(ax):
    ax.plot([0, 1, 2, 3], [0.0438, 0.0431, 0.0426, 0.0407])
    ax.set_yscale("log")
    low, high = readable_ylim(ax)
    assert high / low == pytest.approx(10.0)
    assert low < 0.0407 and high > 0.0438
    ax.figure.canvas.draw()
    labels = [t.get_text() for t in (*ax.get_yticklabels(), *ax.get_yticklabels(minor=True)) if t.get_text()]
    assert "0.04" in labels and not any("10^" in label or "times" in label for label in labels)


def test_layer_axis_names_layer_0_and_ticks_whole_layers(ax):
    ax.plot([0, 1, 2, 3], [1, 2, 3, 4])
    layer_axis(ax)
    assert ax.get_xlabel() == LAYER_AXIS == "layer (0 = embeddings)"
    assert all(float(t).is_integer() for t in ax.get_xticks())


# ---- the PNGs the package writes, checked on the figures they save ---------------------------------------


@pytest.fixture
def saved(monkeypatch):
    """The figures the plot functions save, by file name, kept open to be read (nothing is written)."""
    from neutreno.cli import analyze, demo, robustness
    from neutreno.reproduce import report
    from neutreno.studies import rank_collapse, spectrum

    figures = {}

    def keep(fig, path, dpi=110):
        figures[Path(path).name] = fig
        return Path(path)

    for module in (analyze, demo, robustness, report, rank_collapse, spectrum):
        monkeypatch.setattr(module, "save_figure", keep)
    yield figures
    for fig in figures.values():
        pyplot().close(fig)


def below(legend, ax) -> bool:
    """The legend lies under the axes (it hides nothing drawn in them)."""
    ax.figure.canvas.draw()
    return legend.get_window_extent().y1 <= ax.get_window_extent().y0


def test_demo_plot(saved):
    from neutreno.cli.demo import plot_cosine

    flat = [0.61, 0.61002, 0.61005, 0.61001]  # a 5e-5 spread
    runs = {
        "softmax": {"lam": 0.0, "test_accuracy": 0.9, "cosine_by_layer": flat},
        "neutreno": {"lam": 0.6, "test_accuracy": 0.92, "cosine_by_layer": [v - 1e-5 for v in flat]},
    }
    plot_cosine({"model": "vit_digits", "epochs": 2, "seed": 0, "runs": runs}, Path("cosine_by_layer.png"))
    ax = saved["cosine_by_layer.png"].axes[0]
    assert ax.get_xlabel() == LAYER_AXIS and ax.get_ylabel().startswith("token cosine similarity")
    low, high = ax.get_ylim()
    assert high - low == pytest.approx(0.061, rel=1e-3)  # a tenth of 0.61, not 5e-5
    assert "vit_digits" in ax.get_title() and "92.0%" in ax.get_legend().get_texts()[1].get_text()
    assert below(ax.get_legend(), ax)


def test_analyze_spectrum_plot(saved):
    from neutreno.cli.analyze import plot_spectra

    layer = {"layer": 1, "regime": "smooth", "h_eigenvalues": [[0.9, 0.0], [0.004, 0.002], [0.004, -0.002]]}
    plot_spectra(Path("spectrum.png"), {"model a": [layer], "model b": [{**layer, "regime": "sharpen"}]})
    ax = saved["spectrum.png"].axes[0]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("Re λ", "Im λ")
    assert ax.get_xscale() == ax.get_yscale() == "symlog"  # 0.004 and 0.9 both readable
    assert len(saved["spectrum.png"].legends) == 1


def test_rank_collapse_plot(saved):
    from neutreno.studies.rank_collapse import plot

    rows = [
        {"norm": norm, "residual_scale": scale, "attention": "softmax", "depth": depth,
         "last_cosine": 0.5, "q_over_v": 0.041 + 0.001 * depth}
        for norm in ("pre", "post") for scale in ("1", "1/sqrt(L)") for depth in (2, 4, 8)
    ]  # fmt: skip
    plot(rows, Path("rank_collapse.png"), "fan_in")
    fig = saved["rank_collapse.png"]
    top, bottom = fig.axes[0], fig.axes[2]
    fig.canvas.draw()
    assert [t.get_text() for t in bottom.get_xticklabels()] == ["2", "4", "8"]
    low, high = bottom.get_ylim()
    assert high / low == pytest.approx(10.0)  # a decade, not a cliff across 0.043 … 0.049
    assert top.get_ylim() == pytest.approx((-0.02, 1.02)) and "_" not in bottom.get_xlabel()
    assert len(fig.legends) == 1 and fig.legends[0].get_window_extent().y1 <= bottom.get_window_extent().y0


def test_spectrum_study_plot(saved):
    from neutreno.studies.spectrum import plot

    variant = {"top1": 60.0, "high_frequency": [2.0, 1.0, 0.5, 0.25], "cosine": [0.3, 0.30004, 0.3, 0.30001]}
    plot({"variants": {"softmax": variant}, "images": 80, "data": "/x/digits"}, Path("spectrum_study.png"))
    left, right = saved["spectrum_study.png"].axes
    assert left.get_xlabel() == right.get_xlabel() == LAYER_AXIS
    assert "high-frequency ratio" in left.get_ylabel() and left.get_yscale() == "log"
    assert right.get_ylabel() == "token cosine similarity"
    low, high = right.get_ylim()
    assert high - low >= 0.03


def test_robustness_plot(saved, tmp_path):
    from neutreno.cli.robustness import write_report

    errors = {name: {"1": 20.0, "3": 30.0, "5": 40.0} for name in ("gaussian_noise", "fog", "contrast")}
    report = {"checkpoint": "x", "clean": {"top1": 85.0}, "error": errors}
    write_report(tmp_path, {"model": report, "baseline": report, "ce": {}, "mce": 100.0})
    fig = saved["robustness.png"]
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["gaussian noise", "fog", "contrast"]
    assert panels[0].get_ylabel() == "top-1 error (%)"
    assert all(ax.get_xlabel() == "severity" for ax in panels)
    assert all(float(t).is_integer() for t in panels[0].get_xticks())


def test_reproduce_plot(saved):
    from neutreno.reproduce.report import plot

    spec = {"kind": "lines", "x": [0, 1, 2, 3], "series": {"softmax": [0.9999, 0.99991, 0.99995, 0.99992]},
            "xlabel": LAYER_AXIS, "ylabel": "head redundancy"}  # fmt: skip
    title = "The paper's claim: NeuTRENO lowers head redundancy between successive layers (quick scale)"
    plot(spec, Path("plot.png"), title)
    ax = saved["plot.png"].axes[0]
    assert all(float(t).is_integer() for t in ax.get_xticks())
    low, high = ax.get_ylim()
    assert high - low >= 0.09
    assert "\n" in ax.get_title() and ax.get_title().replace("\n", " ") == title
    bars = {"kind": "bars", "bars": {"train_flops": 1.0, "inference_s": 1.02}, "ylabel": "cost ratio",
            "reference": {"equal cost": 1.0}}  # fmt: skip
    plot(bars, Path("bars.png"), "costs")
    ax = saved["bars.png"].axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["train flops", "inference s"]
    assert below(saved["bars.png"].legends[0], ax)


def test_a_line_break_in_a_markdown_cell_does_not_end_its_row():
    """A failure's reason with a traceback's line breaks cut its row short and moved the next row out of
    the table."""
    from neutreno.reporting import markdown_table

    text = markdown_table([["claim", "why"], ["a", "failed:\nTraceback\r\n  line | 3"], ["b", "ok"]])
    assert text.splitlines() == [
        "| claim | why |",
        "|---|---|",
        "| a | failed: Traceback   line \\| 3 |",
        "| b | ok |",
    ]
