"""``elasticd.Trainer``: Hugging Face ``transformers.Trainer`` scripts under elasticd (``trainer.py``), with their
data cut the same at every world size (``steps.py``), their checkpoints committed into the run's lineage
(``commits.py``) and the daemon's signals through Trainer's callback events (``callback.py``)."""
