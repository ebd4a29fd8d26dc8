"""The hot path of one batch: batching, the step, row bookkeeping, optimizers, ranking, CUDA graphs, precision."""
