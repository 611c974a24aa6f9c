"""The demos' figure: one quantity per panel, each axis labelled with its unit, a missing quantity said."""

from __future__ import annotations

from conftest import need

need("matplotlib")

from slime_ascend.demo import plots  # noqa: E402


def test_each_panel_is_one_quantity_with_a_unit():
    titles = [name for _, name, _, _ in plots.PANELS]
    assert "Distance to the routed teacher" in titles  # the teacher KL the Quick start's story is about (docs/quickstart.md)
    for series, name, ylabel, _ in plots.PANELS:
        keys = {key.split("_")[0] for key, _ in series}
        assert len(keys) == 1, (name, series)  # reward / reward_short: one quantity, two subsets
        assert any(unit in ylabel for unit in ("nats", "fraction")), ylabel


def test_plot_draws_what_was_measured_and_says_what_was_not(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    history = [{"step": i, "reward": 0.2 + 0.1 * i, "kl": 1.0 / (i + 1), "mismatch": 0.01} for i in range(4)]
    path = plots.plot_curves(history, str(tmp_path / "c.png"), title="run")
    assert (tmp_path / "c.png").stat().st_size > 0 and path.endswith("c.png")
    (fig,) = figures
    axes = fig.axes
    assert [ax.get_title() for ax in axes] == [name for _, name, _, _ in plots.PANELS]
    assert [len(ax.lines) for ax in axes] == [1, 1, 1, 0]  # reward_short and masked_frac were not measured
    assert [t.get_text() for t in axes[3].texts] == ["not measured in this run"]
    assert [ax.get_xlabel() for ax in axes[2:]] == ["training step"] * 2
    assert list(axes[1].lines[0].get_xdata()) == [1, 2, 3, 4]
    assert fig._suptitle.get_text() == "run"
