"""The one layout rule the chapters' figures share: a legend outside the axes, beside them, so
that it never covers the data."""


def legend_outside(ax, **options):
    """Draw `ax`'s legend to the right of the axes, top-aligned; `options` go to `ax.legend`."""
    return ax.legend(
        **{"fontsize": "small", "loc": "upper left", "bbox_to_anchor": (1.01, 1.0), **options}
    )
