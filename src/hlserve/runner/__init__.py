"""The real runner: a PyTorch forward of a batch over paged KV tensors, and sampling."""
