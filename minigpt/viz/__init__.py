"""Seeing inside a model and a run: every layer's attention weights for a prompt as heatmaps
(``attention_maps``), and loss, learning rate and tokens/s of runs' CSV logs (``run_plots``);
``python -m minigpt.viz attention|runs``. matplotlib is imported only when drawing.
"""

from minigpt.viz.attention_maps import attention_maps, plot_attention, token_labels
from minigpt.viz.run_plots import Run, load_run, plot_runs

__all__ = ["Run", "attention_maps", "load_run", "plot_attention", "plot_runs", "token_labels"]
