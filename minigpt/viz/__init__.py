"""Seeing inside a model and a run, without a wandb account.

* ``attention_maps(model, idx)``: every layer's attention weights for a prompt (torch only);
  ``plot_attention`` draws one heatmap per head of a layer, or one per layer (mean of heads).
* ``load_run(run_dir)`` reads a run's metrics from the CSV log every logging run writes;
  ``plot_runs`` draws loss against tokens seen, the learning rate and tokens/s for several runs.

Command line: ``python -m minigpt.viz attention ...`` and ``python -m minigpt.viz runs ...``
(configs/viz.yaml).
matplotlib (a default dependency) is imported only when a figure is drawn.
"""

from minigpt.viz.attention_maps import attention_maps, plot_attention, token_labels
from minigpt.viz.run_plots import Run, load_run, plot_runs

__all__ = ["Run", "attention_maps", "load_run", "plot_attention", "plot_runs", "token_labels"]
