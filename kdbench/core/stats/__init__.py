"""Statistics, torch-free: the samples of one measurement (:mod:`.samples`) and repeats across fresh processes
(:mod:`.repeats`)."""
