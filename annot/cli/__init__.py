"""The ``annot`` command: ``rewrite``, ``plan``, ``verify``."""
