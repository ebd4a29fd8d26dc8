"""Hogwild! worker processes: the pool, how workers start, and the batches they share."""
