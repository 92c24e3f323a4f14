"""Context parallelism at run time: a batch's sequence split over the cp ranks
(:mod:`annot.runtime.cp.sequence`), attention over the whole sequence from each
rank's queries (:mod:`annot.runtime.cp.attention`)."""
