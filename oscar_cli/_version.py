"""The package version, in a module of its own (importing it pulls in nothing else)."""

__version__ = "0.1.0"
