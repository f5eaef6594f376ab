"""kvwire's version, in a module of its own so that any stage can name it without importing the package root
(pyproject.toml carries the same number)."""

__version__ = "0.1.0"
