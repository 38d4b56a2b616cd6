"""kvc: a durable continuation catalog for language-model inference."""

__version__ = "0.1.0"
