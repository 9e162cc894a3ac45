"""bragg-reshard's Python side: `bragg_reshard.ray` runs its ranks as Ray tasks."""
