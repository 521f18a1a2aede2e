"""Model registry, weight loading and Baton's own paged forward pass."""
