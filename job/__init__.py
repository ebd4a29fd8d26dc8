"""biggraph: PyTorch-BigGraph-compatible graph embedding training, built for object storage and Kubernetes."""

__version__ = "0.1.0"
