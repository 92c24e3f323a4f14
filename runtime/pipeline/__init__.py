"""The pipeline executor: schedules as data, stages exchanging activations over
p2p, the step a model call and backward run through."""
