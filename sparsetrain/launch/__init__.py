"""How ranks come to exist: ``env`` (the only reader of RANK / SLURM_* / TORCHELASTIC_*),
``spawn`` (local ranks through torch's elastic launcher), ``worker`` (one rank's life: process
group, trainer, teardown), ``cli`` (``python -m sparsetrain.run``: Hydra, validation, launch).

Kept free of imports so that ``config`` can use ``launch.env`` without pulling in the CLI.
"""
