"""`shinkai bench speculative` and the draft proposal's breakdown: DSpark's speed against speculation off."""
