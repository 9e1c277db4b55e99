"""Graders: how a task set scores what a harness left (``tests``: hidden tests; ``wordmap``: similarity)."""
