"""Everything ``train.py`` runs, one job a module.

``config`` (checks before any work), ``model_init`` (vocabulary, fresh or pretrained weights),
``optim`` (AdamW groups, the LR schedule), ``device`` (precision, GPU peaks), ``lit`` (the
LightningModule), ``rng`` (RNG state in checkpoints), ``callbacks``, ``loggers``, ``trainer``
(the Lightning ``Trainer``), and ``run`` (``run(cfg)``, what ``train.py`` calls).
"""
