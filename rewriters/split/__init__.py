"""The pipeline split, source to source: where a boundary can cut ``forward``
(at any depth of nested calls) and one method per stage."""
