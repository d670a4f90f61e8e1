"""The package version (``samepath.__version__``): a leaf every room may import."""

__version__ = "0.1.0"
