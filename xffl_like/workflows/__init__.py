"""Launch recipes: Slurm sbatch scripts (``python -m xffl_like.workflows.slurm``)."""
