"""How a tensor goes to host and comes back: one module per Keras back end."""
