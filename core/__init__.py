"""The library: backends, tensors and graphs, autodiff, optimizers, models, the training loop."""
