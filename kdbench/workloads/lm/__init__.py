"""The language-model family's wing: the workload (:mod:`.workload`), its plan checks (:mod:`.checks`), serving
(:mod:`.serving`), speculative decoding (:mod:`.speculative`) and cross-tokenizer cells (:mod:`.xtok`)."""
