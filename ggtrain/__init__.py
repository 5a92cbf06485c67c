"""ggtrain: train and fine-tune GGUF models (layer 0: version, errors, __main__)."""
__version__ = "0.1.0"
