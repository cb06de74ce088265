"""Target producer: data, the frozen target forward, features into the ring."""
