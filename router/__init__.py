"""An OpenAI-compatible router: one endpoint, many models, pluggable backends."""

__version__ = "0.1.0"
