// No `mod orphan;` anywhere.
