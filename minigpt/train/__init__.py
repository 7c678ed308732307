"""Everything ``train.py`` runs, one job a module; ``run.run(cfg)`` is what it calls. The data is
``minigpt.data``'s, checkpoints are ``minigpt.checkpoint``'s."""
