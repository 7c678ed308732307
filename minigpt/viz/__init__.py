"""Seeing inside a model and a run, without a wandb account: ``attention_maps`` and
``plot_attention`` (every layer's attention weights for a prompt, as heatmaps), ``load_run`` and
``plot_runs`` (loss, learning rate and tokens/s from the CSV log of several runs). Command line:
``python -m minigpt.viz attention|runs ...``; matplotlib is imported only when drawing.
"""

from minigpt.viz.attention_maps import attention_maps, plot_attention, token_labels
from minigpt.viz.run_plots import Run, load_run, plot_runs

__all__ = ["Run", "attention_maps", "load_run", "plot_attention", "plot_runs", "token_labels"]
