"""Tests of annot.runtime (the repository's runtime/ folder): one test file per concern."""
