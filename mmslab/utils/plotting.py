"""The figure boilerplate of mmslab's tools and benchmarks: a headless matplotlib figure that is
saved and closed on exit, and grouped bar charts."""
from contextlib import contextmanager
from typing import Dict, Sequence


@contextmanager
def saved_figure(path: str, ncols: int = 1, panel_size=(6, 4), **subplots_kwargs):
    """``with saved_figure(path, ncols) as (fig, axes):`` draw on ``axes[0][i]``; on exit the
    figure is laid out, written to ``path`` (100 dpi) and closed. No display is needed."""
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    figsize = subplots_kwargs.pop('figsize', (panel_size[0] * ncols, panel_size[1]))
    fig, axes = plt.subplots(1, ncols, figsize=figsize, squeeze=False, **subplots_kwargs)
    try:
        yield fig, axes
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def grouped_bars(ax, categories: Sequence[str], series: Dict[str, Sequence[float]],
                 horizontal: bool = False, **bar_kwargs) -> None:
    """One group of bars per category, one bar per series in each group, with a legend.

    ``series``: label -> one value per category. ``bar_kwargs`` go to every ``ax.bar`` call
    (``color`` may also be a list, one color per series).
    """
    width = 0.8 / max(len(series), 1)
    colors = bar_kwargs.pop('color', None)
    for i, (label, values) in enumerate(series.items()):
        kwargs = dict(bar_kwargs)
        if colors is not None:
            kwargs['color'] = colors[i]
        positions = [j + i * width for j in range(len(categories))]
        if horizontal:
            ax.barh(positions, values, height=width, label=label, **kwargs)
        else:
            ax.bar(positions, values, width, label=label, **kwargs)
    ticks = [j + width * (len(series) - 1) / 2 for j in range(len(categories))]
    if horizontal:
        ax.set_yticks(ticks)
        ax.set_yticklabels(categories)
        ax.invert_yaxis()
    else:
        ax.set_xticks(ticks)
        ax.set_xticklabels(categories)
