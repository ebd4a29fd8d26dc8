"""On-disk formats shared with PyTorch-BigGraph: input v1, checkpoints, and the legacy format."""
