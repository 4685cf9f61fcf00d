"""Data sources: synthetic Markov text and Wikipedia-format JSON, both as fixed-length token blocks."""
