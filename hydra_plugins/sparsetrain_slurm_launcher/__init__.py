# sparsetrain's SLURM launcher (conf/hydra/launcher/slurm.yaml); see launcher.py.
