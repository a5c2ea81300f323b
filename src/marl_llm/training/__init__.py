"""The training loop (trainer.py, read top to bottom), joint-action trees (episodes.py), evaluation and performance accounting."""
