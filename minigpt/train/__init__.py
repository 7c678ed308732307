"""Everything ``train.py`` runs, one job a module.

``config`` (checks before any work), ``plan`` (device, precision, compile, CPU speedups,
processes and the global batch, resolved once), ``preflight`` (will a step fit in memory),
``launch`` (Lightning Fabric for the plan), ``model_init`` (vocabulary, fresh or pretrained
weights), ``optim`` (AdamW groups, the LR schedule), ``loop`` (the training loop),
``sample``, ``interrupt`` (Ctrl-C and SIGTERM), ``loggers``, ``rng``, and ``run`` (``run(cfg)``,
what ``train.py`` calls). Checkpoints (writing, resuming) are ``minigpt.checkpoint``'s.
"""
