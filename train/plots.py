"""The training curves of one ``python -m train`` invocation as a PNG (matplotlib, headless)."""

from pathlib import Path


def plot_runs(results, path) -> Path:
    """Training loss against step for every run of ``results`` (``train.loop.RunResult``s) on a
    log scale, each labelled with its last held-out accuracy; written to ``path`` (PNG).
    Raises ImportError naming the missing package when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("--plot needs matplotlib (pip install matplotlib, or the project's "
                          "[dev] extras that setup.sh installs)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    fig, ax = plt.subplots(figsize=(7, 4))
    for n, r in enumerate(results):
        steps = sorted(r.losses)
        accuracy = r.evaluation.get("accuracy")
        label = r.name if accuracy is None else f"{r.name}  (held-out accuracy {accuracy:.3f})"
        ax.plot(steps, [r.losses[s] for s in steps], label=label, linewidth=1.2,
                linestyle=("-", "--", ":", "-.")[n % 4])
    ax.set(xlabel="step", ylabel="training loss", yscale="log")
    for axis in (ax.yaxis.set_major_formatter, ax.yaxis.set_minor_formatter):
        axis(FormatStrFormatter("%g"))
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
