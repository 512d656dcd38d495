"""Quality on real data: data sets, the training loop, and the seed protocol (see :mod:`.protocol`)."""
