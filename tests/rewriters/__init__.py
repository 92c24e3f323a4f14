"""Tests of annot.rewriters (the repository's rewriters/ folder): one test file per transform."""
