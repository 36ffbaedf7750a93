"""The benchmarks, each a module run from the repository root: ``python -m benchmarks.<name>``
(``make bench`` runs them all; results go to ``benchmarks/results/``)."""
