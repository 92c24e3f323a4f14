"""Expert parallelism at run time: the experts of a mixture-of-experts layer
split over the ``ep`` ranks (:mod:`annot.runtime.ep.experts`), tokens sent to
them and back by all-to-all (:mod:`annot.runtime.ep.dispatch`)."""
