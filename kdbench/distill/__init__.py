"""Distillation: the step (frozen teacher, student, loss, backward, update; :mod:`.step`), the feature taps
(:mod:`.hooks`), the method registry with one file per method (:mod:`.losses`), and the token-level losses of
language models with their implementations (:mod:`.lm`)."""
