"""Which bucket is trained next: the interfaces, bucket orders, the buffer walk, the group scheduler, the bucket clock."""
