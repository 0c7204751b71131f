"""Checkpoints: this framework's own format and imports from other frameworks' formats."""
