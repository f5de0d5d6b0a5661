"""The ground floor: the vocabulary every stage shares (receiver, enrich, attribution, exporter),
which none of them owns. Nothing here imports a stage (tests/test_layering.py)."""
