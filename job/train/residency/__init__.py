"""Which partitions are in memory: the partition store, the buffer (memory budget and eviction)."""
