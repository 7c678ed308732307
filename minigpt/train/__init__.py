"""Everything ``train.py`` runs, one job a module.

``config`` (checks before any work), ``plan`` (device, precision, compile, CPU speedups,
processes and the batch, ``data.batch_size=auto`` included, resolved before the loop is built),
``memory`` (will a step fit; what fits; an out-of-memory error in one line), ``device``
(precision, compile, Lightning Fabric for the plan), ``model_init`` (vocabulary, fresh or
pretrained weights), ``optim`` (AdamW and Muon groups, the LR schedule), ``loop`` (the training
loop), ``sample``, ``interrupt`` (Ctrl-C and SIGTERM), ``loggers``, ``run_dir`` (one run per
directory), and ``run`` (``run(cfg)``, what ``train.py`` calls). The data a run trains on is
``minigpt.data``'s; checkpoints (writing, resuming) are ``minigpt.checkpoint``'s.
"""
