"""The base floor: what every other floor shares and nothing here imports from above it: the column table
(:mod:`.schema`), names, limits, errors, the registry type, floors, worker state, fake tensors, optional installs,
the device catalogue, sizes in bytes, the speculative-decoding formulas and the statistics (:mod:`.stats`).
Torch-free except where a module says so."""
