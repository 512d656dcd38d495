"""Verdicts of a NEW run against a BASE run: the comparison (:mod:`.compare`), what a verdict is
(:mod:`.verdicts`), how it is written out (:mod:`.format`) and drawn (:mod:`.plots`)."""
