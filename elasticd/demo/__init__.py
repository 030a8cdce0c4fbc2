"""``scripts/demo``: a local elastic job that loses a node and gains one, shown live (``python -m elasticd.demo``)."""
